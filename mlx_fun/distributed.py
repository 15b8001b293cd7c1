"""Data-parallel work under ``mlx.launch``: which samples each rank takes, and summing what the ranks counted.

Launched by MLX's own launcher (``mlx.launch --backend ring -n 2 …`` on one machine; ``--hosts`` / ``--hostfile``
with ring, MPI, JACCL or NCCL between machines), ``mx.distributed.init()`` gives every process its rank; run
without it, the group has one member and everything here is a no-op. Each rank takes every ``size``-th sample of
the length-sorted list (so ranks get about the same number of tokens), accumulates its own float64 saliency
statistics, and :func:`all_reduce` sums them across ranks (``max_activation_norm``: the maximum) on the CPU
stream in float64: counts stay exact, sums differ from one process only by float64 rounding order. Rank 0 alone
writes the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    group: object | None  # mx.distributed.Group, None for a single process

    @property
    def writer(self) -> bool:
        """Whether this process writes outputs (rank 0)."""
        return self.rank == 0


def world() -> World:
    """This process's place in an ``mlx.launch`` run (rank 0 of 1 when not launched)."""
    if not mx.distributed.is_available():
        return World(0, 1, None)
    group = mx.distributed.init()
    return World(group.rank(), group.size(), group if group.size() > 1 else None)


def my_share(samples: Sequence[Sequence[int]], w: World) -> list:
    """The samples rank ``w.rank`` handles: every ``size``-th of them sorted by length (longest first; ties by
    position), so all ranks get about the same number of tokens. The shares partition ``samples``."""
    if w.size == 1:
        return list(samples)
    order = sorted(range(len(samples)), key=lambda i: (-len(samples[i]), i))
    return [samples[i] for i in order[w.rank::w.size]]


def all_reduce(arrays: dict[str, np.ndarray], w: World, maxima: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """Sum float64 ``arrays`` (same keys and shapes on every rank) over the ranks; keys in ``maxima`` take the
    maximum instead. One collective per kind, on the CPU stream (float64 is a CPU type in MLX)."""
    if w.group is None:
        return dict(arrays)
    out = {}
    for keys, op in (([k for k in arrays if k not in maxima], mx.distributed.all_sum),
                     ([k for k in arrays if k in maxima], mx.distributed.all_max)):
        if not keys:
            continue
        flat = np.concatenate([np.asarray(arrays[k], dtype=np.float64).reshape(-1) for k in keys])
        total = op(mx.array(flat, dtype=mx.float64), group=w.group, stream=mx.cpu)
        mx.eval(total)
        total = np.array(total, dtype=np.float64)
        at = 0
        for k in keys:
            n = np.asarray(arrays[k]).size
            out[k] = total[at:at + n].reshape(np.shape(arrays[k]))
            at += n
    return out


def reduce_saliency(acc, w: World) -> None:
    """Sum a :class:`~mlx_fun.saliency.SaliencyAccumulator` over the ranks, in place (token count included)."""
    from .saliency import ARRAY_KEYS

    if w.group is None:
        return
    arrays = {k: getattr(acc, k) for k in ARRAY_KEYS}
    arrays["total_tokens"] = np.array([acc.total_tokens], dtype=np.float64)
    summed = all_reduce(arrays, w, maxima=("max_activation_norm",))
    for k in ARRAY_KEYS:
        getattr(acc, k)[...] = summed[k]
    acc.total_tokens = int(summed["total_tokens"][0])
