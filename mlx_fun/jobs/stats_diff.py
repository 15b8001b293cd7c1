"""The ``stats-diff`` job: compare one saliency metric between two saliency files of the same model."""

from __future__ import annotations

from pathlib import Path

from ..errors import param


def run(*, file1: str | Path, file2: str | Path, metric: str = "reap", output: str | Path | None = None) -> dict:
    """The report of :func:`mlx_fun.stats.diff` (``score(file1) − score(file2)``: statistics, sign distribution, top
    differing experts, warnings, the whole matrix) with the file names; also written as JSON to ``output``."""
    from .. import writer
    from ..saliency import SaliencyAccumulator
    from ..stats import diff

    inputs = {param("file1"): file1, param("file2"): file2}
    if output is not None:
        writer.check_output_path(output, kind="file", inputs=inputs)
    a, b = SaliencyAccumulator.load(file1, name="file1"), SaliencyAccumulator.load(file2, name="file2")
    report = {"file1": str(file1), "file2": str(file2), **diff(a, b, metric, labels=(str(file1), str(file2)))}
    if output is not None:
        writer.write_json(output, report, inputs=inputs)
    return report
