"""Offline calibration: run token batches through a hooked model and accumulate routing statistics.

One forward per batch; the hooks hand each MoE layer's (inds, weights, y) to a ``SaliencyTap``, which keeps the
per-expert output norms lazily; the batch's norms, indices and weights are evaluated together with the forward
pass and fed to the float64 accumulator once per layer. The final norm and LM head are never evaluated (only
the taps' arrays are), so collect does no work that routing statistics do not need.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from . import engine, moe_hook
from .adapters.base import MoEAdapter
from .saliency import SaliencyAccumulator


class SaliencyTap:
    """Keeps (layer, inds, weights, norms) of the current forward as lazy arrays.

    ``norms=False`` records frequencies and router weights only (the server's lightweight mode).
    """

    def __init__(self, norms: bool = True):
        self.norms = norms
        self.pending: list[tuple[int, mx.array, mx.array, mx.array | None]] = []

    def __call__(self, layer, inds, weights, logits, y):
        n = mx.linalg.norm(y.astype(mx.float32), axis=-1) if self.norms else None
        self.pending.append((layer, inds, weights.astype(mx.float32), n))

    def flush(self, acc: SaliencyAccumulator, valid: np.ndarray | None = None, evaluate=mx.eval) -> int:
        """Evaluate what the last forward recorded and add it to ``acc``.

        ``valid`` is a boolean mask over the batch's token positions (False for padding); returns the number
        of tokens counted. ``evaluate`` evaluates the arrays (the engine's ``chunk.eval`` adds the KV cache).
        """
        pending, self.pending = self.pending, []
        arrays = [a for item in pending for a in item[1:] if a is not None]
        evaluate(*arrays)
        counted = 0
        for layer, inds, weights, norms in pending:
            k = inds.shape[-1]
            i = np.array(inds).reshape(-1, k)
            w = np.array(weights).reshape(-1, k)
            n = None if norms is None else np.array(norms).reshape(-1, k)
            if valid is not None:
                mask = valid.reshape(-1)
                i, w = i[mask], w[mask]
                n = None if n is None else n[mask]
            acc.update(layer, i, w, n)
            counted = len(i)
        return counted


def collect(
    model,
    adapter: MoEAdapter,
    samples: Sequence[Sequence[int]],
    *,
    batch_size: int = 1,
    acc: SaliencyAccumulator | None = None,
    norms: bool = True,
    pad_id: int = 0,
    token_budget: int | None = None,
    progress: bool = False,
    progress_scale: float = 1.0,
    evaluate_output: bool = False,
) -> SaliencyAccumulator:
    """Accumulate routing statistics of ``samples`` (lists of token ids) into ``acc`` (new if None).

    Runs on :func:`mlx_fun.engine.run`: length-bucketed batches (right-padded, padding excluded from the
    statistics; causal attention means padding never changes the real tokens), at most ``token_budget`` tokens
    per forward. Hooks are always removed, also on error or Ctrl-C. ``evaluate_output`` evaluates each forward's
    output with the taps (a model split by layers: its send / receive / gather run only in the output's graph).
    """
    acc = acc or SaliencyAccumulator.for_adapter(adapter)
    tap = SaliencyTap(norms=norms)

    def on_chunk(chunk, output):  # the output (logits) is not evaluated unless asked: only the taps' arrays are
        valid = chunk.valid
        evaluate = (lambda *a: chunk.eval(*a, output)) if evaluate_output else chunk.eval
        tap.flush(acc, None if valid.all() else valid, evaluate=evaluate)

    with moe_hook.hooked(adapter, [tap]):
        acc.total_tokens += engine.run(model, samples, on_chunk, batch_size=batch_size, pad_id=pad_id,
                                       budget=token_budget, progress=progress, desc="collect",
                                       progress_scale=progress_scale)
    return acc
