"""What ``tune-dispatch`` measures: the option group :class:`Measurement` (``measure``) of the job.

Kept apart from :mod:`mlx_fun.dispatch.tune` (which re-exports it) because every job's signature is built when
:mod:`mlx_fun.jobs` is imported, and the measuring code imports mlx-lm: this module imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

import click

from ..core.options import Group, option
from ..core.ranges import FiniteFloat
from ..errors import UserError, param


def int_list(text: str, what: str) -> list[int]:
    """Comma-separated positive integers of parameter ``what``, else a one-line ``UserError`` naming it."""
    try:
        values = [int(v) for v in str(text).replace(" ", "").split(",") if v]
    except ValueError:
        raise UserError(f"{param(what)} must be comma-separated integers, got {text!r}.") from None
    if not values or min(values) < 1:
        raise UserError(f"{param(what)} must list positive integers, got {text!r}.")
    return values


@dataclass(frozen=True)
class Measurement(Group):
    """How each expert shape is measured (fields = ``tune-dispatch`` options; checked when built, the lists too).

    ``ms``: token counts M to time (comma-separated); ``max_m``: skip M above this (the last band extends);
    ``blocks``: block sizes R of the blocked plans; ``no_dequant``: do not try dequantize-then-gather_mm plans;
    ``margin``: a plan replaces mlx-lm's only where it is at least this fraction (and 20 µs) faster;
    ``repeats``: minimum timed calls per plan and M."""

    ms: str = option("1,2,4,8,16,32,64,128,256,512,1024,2048,4096", "Token counts M to measure.", type=click.STRING)
    max_m: int | None = option(None, "Skip M above this (large M on a slow CPU takes minutes per call); the last "
                               "band extends.", type=click.IntRange(min=1))
    blocks: str = option("8,16,32,64", "Block sizes R tried for the blocked plans.", type=click.STRING)
    no_dequant: bool = option(False, "Do not try dequantize-then-gather_mm plans for quantized experts.")
    margin: float = option(0.05, "A plan replaces mlx-lm's only where it is at least this much (fraction) and 20 µs "
                           "faster.", type=FiniteFloat(min=0.0, max=0.5))
    repeats: int = option(3, "Minimum timed calls per plan and M (more for fast calls, up to 100; 1 for calls over "
                          "5 s).", type=click.IntRange(min=1))

    def validate(self) -> None:
        int_list(self.ms, "ms")
        int_list(self.blocks, "blocks")  # their range is checked by block_sizes (the table module imports MLX)

    def token_counts(self) -> list[int]:
        """The distinct ``ms`` up to ``max_m``, ascending (the smallest alone if none is that small)."""
        ms = sorted(set(int_list(self.ms, "ms")))
        if self.max_m:
            ms = [m for m in ms if m <= self.max_m] or [min(ms)]
        return ms

    def block_sizes(self) -> tuple[int, ...]:
        """The distinct ``blocks``, ascending, each in the range a blocked plan takes
        (:data:`mlx_fun.dispatch.table.BLOCK_RANGE`)."""
        from .table import BLOCK_RANGE

        sizes = tuple(sorted(set(int_list(self.blocks, "blocks"))))
        low, high = BLOCK_RANGE
        if sizes[0] < low or sizes[-1] > high:
            bad = next(r for r in sizes if not low <= r <= high)
            raise UserError(f"{param('blocks')}: a block size must be {low} to {high} rows (each expert's rows are "
                            f"padded to a multiple of it), got {bad}.")
        return sizes


__all__ = ["Measurement", "int_list"]
