"""The ``safety-scan`` job: harmful vs benign routing → ``safety_report.json`` (HCDG, HRCG, safety-critical)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from ..core.options import Opt
from ..datasets.calibration import Calibration
from ..model.lora import ADAPTER_PATH
from ..settings import RunSettings
from .common import DATASET, FORCE, MODEL, PERCENTILE, SCAN_OUTPUT, STREAM_LAYERS, Log, differential_job, job, quiet


#: the two prompt sets safety-scan compares and abliterate takes its directions from
HARMFUL_DATASET = Opt("Harmful prompts: JSONL (chats are read with their generation prompt) or a directory.",
                      missing=DATASET.missing)
BENIGN_DATASET = Opt("Benign prompts, same formats.", missing=DATASET.missing)


@dataclass
class ScanResult:
    output: Path
    report: dict

    def group_sizes(self) -> dict[str, int]:
        keys = [k for k in ("hcdg", "hrcg", "safety_critical", "domain_experts", "general_experts") if k in self.report]
        return {k: sum(len(v) for v in self.report[k].values()) for k in keys}


@job
def run(
    *,
    model: Annotated[str | Path, MODEL],
    adapter_path: Annotated[str | Path | None, ADAPTER_PATH] = None,
    harmful_dataset: Annotated[str | Path, HARMFUL_DATASET],
    benign_dataset: Annotated[str | Path, BENIGN_DATASET],
    output: Annotated[str | Path, SCAN_OUTPUT],
    force: Annotated[bool, FORCE] = False,
    calibration: Calibration = Calibration(batch_size=4),
    threshold_percentile: Annotated[float, PERCENTILE] = 90.0,
    settings: RunSettings = RunSettings(),
    stream_layers: Annotated[bool | None, STREAM_LAYERS] = None,
    log: Log = quiet,
) -> ScanResult:
    """Route ``harmful_dataset`` and ``benign_dataset`` (chats are read with their generation prompt) through
    ``model`` and write the report (:mod:`mlx_fun.observe.differential`): experts at or above the
    ``threshold_percentile``-th risk difference over all layers and more active on harmful prompts (HCDG), at or
    below the complementary percentile and more active on benign ones (HRCG), their union (``safety_critical``),
    every score.
    ``calibration``: how each set's samples are drawn and batched (its fields may be given by name).
    ``stream_layers`` (None: when the model's weights exceed the memory left): the model loads lazily and both sets
    run together through one streamed forward, one decoder layer's weights in memory at a time (the same report:
    counts exactly, scores to float rounding); no resume. ``adapter_path``: a LoRA adapter fused into the model
    (:mod:`mlx_fun.model.lora`), recorded in the report."""
    report = differential_job(
        "safety", model=model, dataset_a=("harmful_dataset", harmful_dataset),
        dataset_b=("benign_dataset", benign_dataset), output=output, calibration=calibration,
        threshold_percentile=threshold_percentile, settings=settings, log=log, force=force, stream_layers=stream_layers,
        adapter_path=adapter_path)
    return ScanResult(Path(output), report)
