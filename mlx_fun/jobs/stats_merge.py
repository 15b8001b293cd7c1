"""The ``stats-merge`` job: rank-merge saliency files of several datasets into one."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Sequence

import click

from ..core.options import Opt
from ..errors import UserError, param
from ..experts.selection import METRIC
from .common import FORCE, job


@dataclass
class StatsMergeResult:
    merged: object  # SaliencyAccumulator with extra rank_sum_<metric>
    output: Path
    metric: str
    files: int
    warnings: list[str] = field(default_factory=list)


@job
def run(*, files: Annotated[Sequence[str | Path], Opt("Saliency .npz to merge; repeat for each file (at least 2, same "
                                                      "model).", type=click.Path(), multiple=True, required=True)],
        output: Annotated[str | Path, Opt("Merged saliency .npz to write.")],
        force: Annotated[bool, FORCE] = False,
        metric: Annotated[str, METRIC] = "reap") -> StatsMergeResult:
    """Rank every file's experts per layer by ``metric`` and sum the ranks (:func:`mlx_fun.observe.stats.rank_merge`);
    write the result (raw statistics summed, plus the rank sums) to ``output`` (an existing file only with
    ``force``)."""
    from ..core import writer
    from ..observe.saliency import SaliencyAccumulator
    from ..observe.stats import merge_warnings, rank_merge

    files = [str(f) for f in files]
    writer.check_output_path(output, kind="file", force=force)
    if len(files) < 2:
        raise UserError(f"stats-merge needs at least 2 saliency files, got {len(files)}; repeat {param('files')}.")
    accs = [SaliencyAccumulator.load(f, name="files") for f in files]
    warnings = merge_warnings(accs, metric, files)
    merged = rank_merge(accs, metric, labels=files)
    merged.save(output, force=force)
    return StatsMergeResult(merged, Path(output), metric, len(files), warnings)
