"""The ``stats-purge`` job: zero out experts with too little activation evidence in a saliency file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from ..core.options import Opt
from ..core.ranges import FiniteFloat
from ..errors import UserError, param
from .common import FORCE, job


@job
def run(*, input: Annotated[str | Path, Opt("Saliency .npz to clean.")],
        output: Annotated[str | Path, Opt("Purged saliency .npz to write (same shape).")],
        force: Annotated[bool, FORCE] = False,
        min_freq: Annotated[float | None, Opt("Zero out entries routed fewer than this many times (freq < MIN_FREQ).",
                                              type=FiniteFloat(min=0))] = None,
        min_count: Annotated[float | None, Opt("Zero out entries with fewer than this many output-norm samples "
                                               "(reap_count < MIN_COUNT).", type=FiniteFloat(min=0))] = None,
        max_norm: Annotated[float | None, Opt("Only report entries whose max activation norm exceeds this; nothing "
                                              "is capped or zeroed.", type=FiniteFloat(min=0))] = None) -> dict:
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
    writer.check_output_path(output, kind="file", force=force)
    acc = SaliencyAccumulator.load(input, name="input")
    purged, report = purge(acc, min_freq=min_freq, min_count=min_count, max_norm=max_norm)
    if report["kept"] == 0:
        refuse_purging_everything(acc, min_freq, min_count)
    purged.save(output, force=force)
    return report
