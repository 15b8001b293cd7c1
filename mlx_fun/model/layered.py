"""The layered driver: calibration hidden states carried through the decoder layers one at a time.

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

It is also the streamed forward (``collect --stream-layers``, :func:`mlx_fun.observe.collect.collect_streamed`):
``run(after_batch=...)`` hands each batch's output of layer ``i`` (computed once, through the installed hooks) to
the caller before it becomes the next layer's input, ``release=True`` empties each visited layer's parameters (a
lazily loaded model then holds one layer's weights at a time), ``start`` resumes at a layer with hidden states
restored from a checkpoint (:meth:`LayerDriver.hidden_states`, :meth:`LayerDriver.restore`) and ``on_done(i)``
runs once layer ``i``'s outputs are evaluated (a checkpoint).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from . import engine, layerwise
from ..adapters.base import MoEAdapter


@dataclass
class LayerBatch:
    """One calibration batch: its hidden state entering the current layer and its per-layer call arguments."""

    index: int
    h: mx.array | None
    calls: layerwise.LayerCalls
    valid: np.ndarray  # (B, L) True for real (not padding) tokens
    group: int = 0  # which of the driver's sample sets the batch's samples come from
    tokens: np.ndarray | None = None  # (B, L) the token ids fed (right-padded)
    rows: np.ndarray | None = None  # (B,) each row's index in its sample set


class LayerDriver:
    """Hidden states of ``samples`` carried through ``adapter``'s decoder layers (see the module docstring).

    ``more``: further sample sets carried in the same pass (each layer's weights visited once for all of them),
    batched apart from ``samples`` and each other: a batch's ``group`` is 0 for ``samples``, 1 for ``more[0]``, ...
    (a differential scan's two datasets)."""

    def __init__(self, model, adapter: MoEAdapter, samples: Sequence[Sequence[int]], *, batch_size: int = 8,
                 pad_id: int = 0, token_budget: int | None = None, more: Sequence[Sequence[Sequence[int]]] = ()):
        self.model, self.adapter = model, adapter
        self.layers = adapter.decoder_layers()
        self.batches: list[LayerBatch] = []
        for group, sample_set in enumerate([samples, *more]):
            for tokens, lengths, rows in engine.batches(sample_set, batch_size, pad_id=pad_id, budget=token_budget):
                calls = layerwise.record_layer_calls(model, self.layers, mx.array(tokens), adapter.layer_passthrough)
                mx.eval(calls.h)
                h, calls.h = calls.h, None  # one reference only: replaced layer after layer
                valid = np.arange(tokens.shape[1])[None, :] < np.asarray(lengths)[:, None]
                self.batches.append(LayerBatch(len(self.batches), h, calls, valid, group, tokens, rows))
        self.seconds: dict[int, float] = {}

    @property
    def n_tokens(self) -> int:
        return int(sum(b.valid.sum() for b in self.batches))

    def group_tokens(self, group: int) -> int:
        """The real tokens of sample set ``group`` (0: ``samples``, 1: ``more[0]``, ...)."""
        return int(sum(b.valid.sum() for b in self.batches if b.group == group))

    def replay(self, i: int, before: Callable[[LayerBatch], bool] | None = None) -> None:
        """Run layer ``i`` on every batch (``before(batch)`` may prepare taps, or return False to skip it); the
        outputs are dropped: taps keep, lazily, what they need and evaluate it themselves."""
        for b in self.batches:
            if before is None or before(b):
                layerwise.run_layer(self.layers[i], b.h, b.calls, i)

    def run(self, on_layer: Callable[[int], None] | None = None, *, last: int | None = None, progress: bool = False,
            desc: str = "layers", start: int = 0, release: bool = False,
            after_batch: Callable[[int, LayerBatch, mx.array], Sequence[mx.array]] | None = None,
            on_done: Callable[[int], None] | None = None) -> None:
        """``on_layer(i)`` for every decoder layer from ``start`` up to ``last`` (default: the last MoE layer), each
        followed by pushing the hidden states through layer ``i``; ``seconds[i]`` records each layer's time.

        ``after_batch(i, batch, out)``: called with each batch's (lazy) output of layer ``i`` before it replaces
        the batch's hidden state; the arrays it returns are evaluated with the output (the last layer is then run
        too). ``release``: each visited layer's parameters are emptied (:func:`release_layer`). ``on_done(i)``:
        once layer ``i``'s outputs are evaluated (and the layer released)."""
        last = self.adapter.moe_layers()[-1] if last is None else last
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=last + 1, initial=start, unit="layer", desc=desc, dynamic_ncols=True)
        try:
            for i in range(start, last + 1):
                t0 = time.perf_counter()
                if on_layer is not None:
                    on_layer(i)
                if i < last or after_batch is not None:  # nothing after the last layer is needed
                    self.step(i, keep=i < last, after_batch=after_batch)
                if release:
                    release_layer(self.layers[i])
                self.seconds[i] = round(time.perf_counter() - t0, 4)
                if on_done is not None:
                    on_done(i)
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            for b in self.batches:  # free the hidden states
                b.h = None

    def step(self, i: int, *, keep: bool = True,
             after_batch: Callable[[int, LayerBatch, mx.array], Sequence[mx.array]] | None = None) -> None:
        """Push every batch's hidden state through layer ``i`` (through the installed hooks), each batch's output
        evaluated (with what ``after_batch`` returns, as in :meth:`run`) and, with ``keep``, its new hidden state
        (else dropped). :meth:`run` is this over the layers; several drivers may be stepped side by side (a model
        and its reference, layer by layer)."""
        for b in self.batches:
            out = layerwise.run_layer(self.layers[i], b.h, b.calls, i)
            arrays = after_batch(i, b, out) if after_batch is not None else ()
            mx.eval(out, *arrays)
            b.h = out if keep else None

    def hidden_states(self) -> dict[str, mx.array]:
        """Every batch's current hidden state by name (``"b<index>"``), for a checkpoint."""
        return {f"b{b.index}": b.h for b in self.batches if b.h is not None}

    def restore(self, states: dict[str, mx.array]) -> None:
        """Set every batch's hidden state from :meth:`hidden_states`' names (a checkpoint); a missing one or a
        shape other than the batch's input is a ``ValueError``."""
        for b in self.batches:
            h = states[f"b{b.index}"]
            if tuple(h.shape) != tuple(b.h.shape):
                raise ValueError(f"batch {b.index}: hidden state {tuple(h.shape)}, expected {tuple(b.h.shape)}")
            b.h = h


def release_layer(layer) -> None:
    """Empty every parameter of ``layer`` (each replaced by a 0-element array of its dtype): a lazily loaded
    layer's weights, read once for its visit, are freed; the layer cannot run again."""
    from mlx.utils import tree_map

    layer.update(tree_map(lambda a: mx.zeros((0,), a.dtype), layer.parameters()))
