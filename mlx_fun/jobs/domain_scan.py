"""The ``domain-scan`` job: domain vs general routing → ``domain_report.json`` (domain and general experts)."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError, param
from ..settings import RunSettings
from .common import Log, differential_job, quiet
from .safety_scan import ScanResult


def run(
    *,
    model: str | Path,
    domain_dataset: str | Path,
    general_dataset: str | Path,
    output: str | Path,
    domain_name: str,
    max_samples: int = 128,
    max_tokens: int = 2048,
    text_key: str = "content",
    threshold_percentile: float = 90.0,
    seed: int | None = None,
    batch_size: int = 4,
    force: bool = False,
    settings: RunSettings = RunSettings(),
    log: Log = quiet,
) -> ScanResult:
    """Route ``domain_dataset`` and ``general_dataset`` through ``model`` and write the report: experts at or
    above the ``threshold_percentile``-th composite score and more active on the domain (``domain_experts``),
    at or below the complementary percentile and more active on general data (``general_experts``)."""
    if not isinstance(domain_name, str) or not domain_name.strip():
        raise UserError(f"{param('domain_name')} must name the domain (e.g. solidity, medical).")
    report = differential_job(
        "domain", model=model, dataset_a=("domain_dataset", domain_dataset),
        dataset_b=("general_dataset", general_dataset), output=output, max_samples=max_samples,
        max_tokens=max_tokens, text_key=text_key, threshold_percentile=threshold_percentile, seed=seed,
        batch_size=batch_size, settings=settings, log=log, extra={"domain_name": domain_name.strip()}, force=force)
    return ScanResult(Path(output), report)
