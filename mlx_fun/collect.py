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

from . import moe_hook
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

    def flush(self, acc: SaliencyAccumulator, valid: np.ndarray | None = None) -> int:
        """Evaluate what the last forward recorded and add it to ``acc``.

        ``valid`` is a boolean mask over the batch's token positions (False for padding); returns the number
        of tokens counted.
        """
        pending, self.pending = self.pending, []
        arrays = [a for item in pending for a in item[1:] if a is not None]
        mx.eval(arrays)
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
    progress: bool = False,
) -> SaliencyAccumulator:
    """Accumulate routing statistics of ``samples`` (lists of token ids) into ``acc`` (new if None).

    Samples are batched by length (right-padded, padding excluded from the statistics; causal attention means
    padding never changes the real tokens). Hooks are always removed, also on error or Ctrl-C.
    """
    from .data import iter_batches

    acc = acc or SaliencyAccumulator.for_adapter(adapter)
    tap = SaliencyTap(norms=norms)
    total = int(sum(len(s) for s in samples))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="tok", unit_scale=True, desc="collect", dynamic_ncols=True)
    try:
        with moe_hook.hooked(adapter, [tap]):
            for tokens, lengths in iter_batches(samples, batch_size, pad_id=pad_id):
                model(mx.array(tokens))  # lazy: only the taps' arrays are evaluated
                valid = np.arange(tokens.shape[1])[None, :] < np.asarray(lengths)[:, None]
                tap.flush(acc, None if valid.all() else valid)
                n = int(np.sum(lengths))
                acc.total_tokens += n
                if bar is not None:
                    bar.update(n)  # tqdm shows the rate in tok/s
    finally:
        if bar is not None:
            bar.close()
    return acc
