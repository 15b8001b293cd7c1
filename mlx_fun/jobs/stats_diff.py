"""The ``stats-diff`` job: compare one saliency metric between two saliency files of the same model."""

from __future__ import annotations

from pathlib import Path

from ..errors import param


def run(*, file1: str | Path, file2: str | Path, metric: str = "reap", output: str | Path | None = None,
        force: bool = False) -> dict:
    """The report of :func:`mlx_fun.observe.stats.diff` (``score(file1) − score(file2)``: statistics, sign distribution, top
    differing experts, warnings, the whole matrix) with the file names; also written as JSON to ``output`` (an
    existing file only with ``force``)."""
    from ..core import writer
    from ..observe.stats import diff_files

    inputs = {param("file1"): file1, param("file2"): file2}
    if output is not None:
        writer.check_output_path(output, kind="file", inputs=inputs, force=force)
    report = diff_files(file1, file2, metric)
    if output is not None:
        writer.write_json(output, report, inputs=inputs, force=force)
    return report
