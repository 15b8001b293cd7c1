"""The ``domain-scan`` job: domain vs general routing → ``domain_report.json`` (domain and general experts)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from ..core.options import Opt
from ..datasets.calibration import Calibration
from ..model.lora import ADAPTER_PATH
from ..errors import UserError, param
from ..settings import RunSettings
from .common import DATASET, FORCE, MODEL, PERCENTILE, SCAN_OUTPUT, STREAM_LAYERS, Log, differential_job, job, quiet
from .safety_scan import ScanResult


@job
def run(
    *,
    model: Annotated[str | Path, MODEL],
    adapter_path: Annotated[str | Path | None, ADAPTER_PATH] = None,
    domain_dataset: Annotated[str | Path, Opt("Domain text: JSONL or a directory of files.",
                                              missing=DATASET.missing)],
    general_dataset: Annotated[str | Path, Opt("General text, same formats.", missing=DATASET.missing)],
    output: Annotated[str | Path, SCAN_OUTPUT],
    force: Annotated[bool, FORCE] = False,
    calibration: Calibration = Calibration(batch_size=4),
    threshold_percentile: Annotated[float, PERCENTILE] = 90.0,
    domain_name: Annotated[str, Opt("Name of the domain (e.g. solidity, medical), kept in the report.")],
    settings: RunSettings = RunSettings(),
    stream_layers: Annotated[bool | None, STREAM_LAYERS] = None,
    log: Log = quiet,
) -> ScanResult:
    """Route ``domain_dataset`` and ``general_dataset`` through ``model`` and write the report: experts at or
    above the ``threshold_percentile``-th composite score and more active on the domain (``domain_experts``),
    at or below the complementary percentile and more active on general data (``general_experts``).
    ``calibration``: how each set's samples are drawn and batched (its fields may be given by name).
    ``stream_layers`` (None: when the model's weights exceed the memory left): the model loads lazily and both sets
    run together through one streamed forward, one decoder layer's weights in memory at a time (the same report:
    counts exactly, scores to float rounding); no resume. ``adapter_path``: a LoRA adapter fused into the model
    (:mod:`mlx_fun.model.lora`), recorded in the report."""
    if not isinstance(domain_name, str) or not domain_name.strip():
        raise UserError(f"{param('domain_name')} must name the domain (e.g. solidity, medical).")
    report = differential_job(
        "domain", model=model, dataset_a=("domain_dataset", domain_dataset),
        dataset_b=("general_dataset", general_dataset), output=output, calibration=calibration,
        threshold_percentile=threshold_percentile, settings=settings, log=log,
        extra={"domain_name": domain_name.strip()}, force=force, stream_layers=stream_layers,
        adapter_path=adapter_path)
    return ScanResult(Path(output), report)
