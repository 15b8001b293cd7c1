"""The ``stats-purge`` job: zero out experts with too little activation evidence in a saliency file."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError, param


def run(*, input: str | Path, output: str | Path, min_freq: float | None = None, min_count: float | None = None,
        max_norm: float | None = None, force: bool = False) -> dict:
    """Zero every statistic of the (layer, expert) entries with ``freq < min_freq`` or ``reap_count <
    min_count`` (``max_norm`` only reports); write the file to ``output`` (an existing one only with ``force``);
    return the report of :func:`mlx_fun.observe.stats.purge`. Thresholds that would purge every expert are refused (the
    file would rank nothing)."""
    from ..core import writer
    from ..observe.saliency import SaliencyAccumulator
    from ..observe.stats import purge, refuse_purging_everything

    if min_freq is None and min_count is None and max_norm is None:
        raise UserError(f"stats-purge needs at least one filter: {param('min_freq')}, {param('min_count')} or "
                        f"{param('max_norm')}.")
    writer.check_output_path(output, kind="file", inputs={param("input"): input}, force=force)
    acc = SaliencyAccumulator.load(input, name="input")
    purged, report = purge(acc, min_freq=min_freq, min_count=min_count, max_norm=max_norm)
    if report["kept"] == 0:
        refuse_purging_everything(acc, min_freq, min_count)
    purged.save(output, inputs={param("input"): input}, force=force)
    return report
