"""The ``stats-diff`` job: compare one saliency metric between two saliency files of the same model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from ..core.options import Opt
from ..experts.selection import METRIC
from .common import FORCE, job


@job
def run(*, file1: Annotated[str | Path, Opt("First saliency .npz (from `mlx-fun collect`).")],
        file2: Annotated[str | Path, Opt("Second saliency .npz of the same model.")],
        metric: Annotated[str, METRIC] = "reap",
        output: Annotated[str | Path | None, Opt("Also write the full report (stats, top lists, whole diff matrix) "
                                                 "as JSON here.")] = None,
        force: Annotated[bool, FORCE] = False) -> dict:
    """The report of :func:`mlx_fun.observe.stats.diff` (``score(file1) − score(file2)``: statistics, sign distribution, top
    differing experts, warnings, the whole matrix) with the file names; also written as JSON to ``output`` (an
    existing file only with ``force``)."""
    from ..core import writer
    from ..observe.stats import diff_files

    if output is not None:
        writer.check_output_path(output, kind="file", force=force)
    report = diff_files(file1, file2, metric)
    if output is not None:
        writer.write_json(output, report, force=force)
    return report
