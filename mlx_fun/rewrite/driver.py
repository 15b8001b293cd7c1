"""The per-layer rewrite driver: calibration hidden states carried through the decoder layers one at a time.

A rewrite that depends on what a layer sees must capture each layer's input *after* the layers before it were
rewritten. Today that is REAM merging alone (:mod:`mlx_fun.rewrite.merge`, the only user of :class:`LayerDriver`);
the other rewrites need no replay: prune slices experts chosen from saliency statistics collected beforehand,
amplify scales selection biases from a scan report, quantize follows a recipe (and the saliency file's cold
layers) — all three data-free; abliterate measures its directions with whole forwards of the model abliterated
so far, then restores the original weights and removes every round's directions at once
(:mod:`mlx_fun.jobs.abliterate`). :class:`LayerDriver` does the capture:

1. it batches the calibration samples like the forward engine (length-bucketed, split by rows to the token
   budget) and records, per batch, the first decoder layer's input and the arguments the model's own forward
   hands every layer (:func:`mlx_fun.model.layerwise.record_layer_calls`: masks, caches — exact for every family);
2. :meth:`LayerDriver.run` visits the layers in order and calls ``on_layer(i)``; the callback may
   :meth:`~LayerDriver.replay` layer ``i`` on every batch (lazily, through whatever hooks are installed, so taps
   capture the MoE block's input, routing and outputs) and rewrite the layer; the driver then pushes every
   batch's hidden state through the (rewritten) layer and evaluates it.

Only one hidden state per calibration token is alive at a time (the layer's input), so the cost is about one
forward pass plus the per-layer work, linear in depth. A single sample is never split (its length is bounded by
``max_tokens``); batches are.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from ..model import engine, layerwise
from ..adapters.base import MoEAdapter


@dataclass
class LayerBatch:
    """One calibration batch: its hidden state entering the current layer and its per-layer call arguments."""

    index: int
    h: mx.array | None
    calls: layerwise.LayerCalls
    valid: np.ndarray  # (B, L) True for real (not padding) tokens


class LayerDriver:
    """Hidden states of ``samples`` carried through ``adapter``'s decoder layers (see the module docstring)."""

    def __init__(self, model, adapter: MoEAdapter, samples: Sequence[Sequence[int]], *, batch_size: int = 8,
                 pad_id: int = 0, token_budget: int | None = None):
        self.model, self.adapter = model, adapter
        self.layers = adapter.decoder_layers()
        self.batches: list[LayerBatch] = []
        for tokens, lengths, _rows in engine.batches(samples, batch_size, pad_id=pad_id, budget=token_budget):
            calls = layerwise.record_layer_calls(model, self.layers, mx.array(tokens), adapter.layer_passthrough)
            mx.eval(calls.h)
            h, calls.h = calls.h, None  # one reference only: replaced layer after layer
            valid = np.arange(tokens.shape[1])[None, :] < np.asarray(lengths)[:, None]
            self.batches.append(LayerBatch(len(self.batches), h, calls, valid))
        self.seconds: dict[int, float] = {}

    @property
    def n_tokens(self) -> int:
        return int(sum(b.valid.sum() for b in self.batches))

    def replay(self, i: int, before: Callable[[LayerBatch], bool] | None = None) -> None:
        """Run layer ``i`` on every batch (``before(batch)`` may prepare taps, or return False to skip it); the
        outputs are dropped: taps keep, lazily, what they need and evaluate it themselves."""
        for b in self.batches:
            if before is None or before(b):
                layerwise.run_layer(self.layers[i], b.h, b.calls, i)

    def run(self, on_layer: Callable[[int], None], *, last: int | None = None, progress: bool = False,
            desc: str = "layers") -> None:
        """``on_layer(i)`` for every decoder layer up to ``last`` (default: the last MoE layer), each followed by
        pushing the hidden states through layer ``i``. ``seconds[i]`` records each layer's time."""
        last = self.adapter.moe_layers()[-1] if last is None else last
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=last + 1, unit="layer", desc=desc, dynamic_ncols=True)
        try:
            for i in range(last + 1):
                t0 = time.perf_counter()
                on_layer(i)
                if i < last:  # nothing after the last layer is needed
                    for b in self.batches:
                        b.h = layerwise.run_layer(self.layers[i], b.h, b.calls, i)
                        mx.eval(b.h)
                self.seconds[i] = round(time.perf_counter() - t0, 4)
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            for b in self.batches:  # free the hidden states
                b.h = None
