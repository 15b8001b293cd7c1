"""The ``stats-merge`` job: rank-merge saliency files of several datasets into one."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..errors import UserError, param


@dataclass
class StatsMergeResult:
    merged: object  # SaliencyAccumulator with extra rank_sum_<metric>
    output: Path
    metric: str
    files: int
    warnings: list[str] = field(default_factory=list)


def run(*, files: Sequence[str | Path], output: str | Path, metric: str = "reap",
        force: bool = False) -> StatsMergeResult:
    """Rank every file's experts per layer by ``metric`` and sum the ranks (:func:`mlx_fun.observe.stats.rank_merge`);
    write the result (raw statistics summed, plus the rank sums) to ``output`` (an existing file only with
    ``force``)."""
    from ..core import writer
    from ..observe.saliency import SaliencyAccumulator
    from ..observe.stats import merge_warnings, rank_merge

    files = [str(f) for f in files]
    writer.check_output_path(output, kind="file", inputs={param("files"): files}, force=force)
    if len(files) < 2:
        raise UserError(f"stats-merge needs at least 2 saliency files, got {len(files)}; repeat {param('files')}.")
    accs = [SaliencyAccumulator.load(f, name="files") for f in files]
    warnings = merge_warnings(accs, metric, files)
    merged = rank_merge(accs, metric, labels=files)
    merged.save(output, inputs={param("files"): files}, force=force)
    return StatsMergeResult(merged, Path(output), metric, len(files), warnings)
