"""The ``safety-scan`` job: harmful vs benign routing → ``safety_report.json`` (HCDG, HRCG, safety-critical)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..settings import RunSettings
from .common import Log, differential_job, quiet


@dataclass
class ScanResult:
    output: Path
    report: dict

    def group_sizes(self) -> dict[str, int]:
        keys = [k for k in ("hcdg", "hrcg", "safety_critical", "domain_experts", "general_experts") if k in self.report]
        return {k: sum(len(v) for v in self.report[k].values()) for k in keys}


def run(
    *,
    model: str | Path,
    harmful_dataset: str | Path,
    benign_dataset: str | Path,
    output: str | Path,
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
    """Route ``harmful_dataset`` and ``benign_dataset`` (chats are read with their generation prompt) through
    ``model`` and write the report (:mod:`mlx_fun.observe.differential`): experts at or above the
    ``threshold_percentile``-th composite score and more active on harmful prompts (HCDG), at or below the
    complementary percentile and more active on benign ones (HRCG), their union (``safety_critical``), every score."""
    report = differential_job(
        "safety", model=model, dataset_a=("harmful_dataset", harmful_dataset),
        dataset_b=("benign_dataset", benign_dataset), output=output, max_samples=max_samples, max_tokens=max_tokens,
        text_key=text_key, threshold_percentile=threshold_percentile, seed=seed, batch_size=batch_size,
        settings=settings, log=log, force=force)
    return ScanResult(Path(output), report)
