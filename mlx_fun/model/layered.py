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

The carried hidden states (every batch's rows × padded length × hidden size, in the model's dtype) are in memory
by default. ``spill`` (a directory) keeps them in files instead, for calibration sets whose hidden states do not
fit beside one layer's weights: each batch's state is written (safetensors, its own dtype: the round trip is
exact) as it is computed, and :attr:`LayerBatch.h` reads it back lazily (``mx.load``) on every access, so only the
batch being pushed through a layer is in memory (its input and output). Each batch alternates between two files,
each written to a temporary name and renamed into place (a new file: a hard link to the old one, a checkpoint's,
keeps its contents), so the file being read as a layer's input is never the one written. The directory is removed
with everything in it by :meth:`LayerDriver.close` (the driver is a context manager), also when building the
driver fails.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import mlx.core as mx
import numpy as np

from . import engine, layerwise
from ..adapters.base import MoEAdapter
from ..core.paths import link_or_copy


@dataclass
class LayerBatch:
    """One calibration batch: its hidden state entering the current layer and its per-layer call arguments."""

    index: int
    state: mx.array | Path | None  # the hidden state :attr:`h`: in memory, or the spill file holding it as "h"
    calls: layerwise.LayerCalls
    valid: np.ndarray  # (B, L) True for real (not padding) tokens
    group: int = 0  # which of the driver's sample sets the batch's samples come from
    tokens: np.ndarray | None = None  # (B, L) the token ids fed (right-padded)
    rows: np.ndarray | None = None  # (B,) each row's index in its sample set

    @property
    def h(self) -> mx.array | None:
        """The hidden state entering the current layer; spilled, a new lazy read of its file at each access (nothing
        of it stays in memory once what was computed from it is evaluated)."""
        return mx.load(str(self.state))["h"] if isinstance(self.state, Path) else self.state

    @h.setter
    def h(self, value: mx.array | None) -> None:
        self.state = value


class LayerDriver:
    """Hidden states of ``samples`` carried through ``adapter``'s decoder layers (see the module docstring).

    ``more``: further sample sets carried in the same pass (each layer's weights visited once for all of them),
    batched apart from ``samples`` and each other: a batch's ``group`` is 0 for ``samples``, 1 for ``more[0]``, ...
    (a differential scan's two datasets).

    ``spill``: a directory (new, or empty) to keep the hidden states in instead of memory (see the module
    docstring), removed by :meth:`close` or on leaving ``with``."""

    def __init__(self, model, adapter: MoEAdapter, samples: Sequence[Sequence[int]], *, batch_size: int = 8,
                 pad_id: int = 0, token_budget: int | None = None, more: Sequence[Sequence[Sequence[int]]] = (),
                 spill: str | os.PathLike | None = None):
        self.model, self.adapter = model, adapter
        self.layers = adapter.decoder_layers()
        self.batches: list[LayerBatch] = []
        self.seconds: dict[int, float] = {}
        self.spill = None if spill is None else Path(spill)
        if self.spill is not None:
            if self.spill.exists() and any(self.spill.iterdir()):
                raise ValueError(f"the spill directory {self.spill} is not empty")
            self.spill.mkdir(parents=True, exist_ok=True)
        try:
            for group, sample_set in enumerate([samples, *more]):
                for tokens, lengths, rows in engine.batches(sample_set, batch_size, pad_id=pad_id,
                                                            budget=token_budget):
                    calls = layerwise.record_layer_calls(model, self.layers, mx.array(tokens),
                                                         adapter.layer_passthrough)
                    mx.eval(calls.h)
                    valid = np.arange(tokens.shape[1])[None, :] < np.asarray(lengths)[:, None]
                    b = LayerBatch(len(self.batches), None, calls, valid, group, tokens, rows)
                    h, calls.h = calls.h, None  # one reference only: replaced layer after layer
                    self._keep(b, h)
                    self.batches.append(b)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> LayerDriver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Drop every batch's hidden state and remove the spill directory (when spilling) with its files."""
        for b in self.batches:
            b.state = None
        if self.spill is not None:
            shutil.rmtree(self.spill, ignore_errors=True)

    def _keep(self, b: LayerBatch, h: mx.array) -> None:
        """Make the evaluated ``h`` batch ``b``'s hidden state: in memory, or (spilling) written to the batch's
        file other than the one it is read from, under a temporary name renamed into place."""
        if self.spill is None:
            b.state = h
            return
        slot = 0 if b.state is None or str(b.state).endswith(".1.safetensors") else 1
        path = self.spill / f"b{b.index}.{slot}.safetensors"
        tmp = self.spill / f"b{b.index}.{slot}.part.safetensors"
        mx.save_safetensors(str(tmp), {"h": h})
        os.replace(tmp, path)
        b.state = path

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

            bar = tqdm(total=last + 1, initial=start, unit="layer", desc=desc, dynamic_ncols=True,
                       postfix=f"{self.n_tokens:,} tokens a layer")
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
                b.state = None

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
            if keep:
                self._keep(b, out)
            else:
                b.state = None

    def hidden_states(self) -> dict[str, mx.array]:
        """Every batch's current hidden state by name (``"b<index>"``), for a checkpoint (spilled: lazy reads, each
        holding its file open until evaluated; :meth:`hidden_files` names the files instead)."""
        return {f"b{b.index}": b.h for b in self.batches if b.state is not None}

    def hidden_files(self) -> dict[str, Path] | None:
        """Spilling: :meth:`hidden_states`' names → the file holding each state (as ``"h"``), which a checkpoint
        may hard-link rather than write again; None when the states are in memory."""
        if self.spill is None:
            return None
        return {f"b{b.index}": b.state for b in self.batches if isinstance(b.state, Path)}

    def restore(self, states: Mapping[str, mx.array | Path]) -> None:
        """Set every batch's hidden state from :meth:`hidden_states`' names (a checkpoint): an array, or a
        safetensors file holding it as ``"h"`` (read at once; spilling, hard-linked, else copied, into the spill
        directory); a missing one is a ``KeyError``, a shape other than the batch's input a ``ValueError``."""
        for b in self.batches:
            h = states[f"b{b.index}"]
            file = Path(h) if isinstance(h, (str, os.PathLike)) else None
            if file is not None:
                h = mx.load(str(file))["h"]
            if tuple(h.shape) != tuple(b.h.shape):
                raise ValueError(f"batch {b.index}: hidden state {tuple(h.shape)}, expected {tuple(b.h.shape)}")
            if self.spill is None:
                if file is not None:
                    mx.eval(h)  # read now: a lazy read keeps its file open, one per batch
                b.state = h
            elif file is None:
                self._keep(b, h)
            else:
                b.state = self.spill / f"b{b.index}.restored.safetensors"
                link_or_copy(file, b.state)


def release_layer(layer) -> None:
    """Empty every parameter of ``layer`` (each replaced by a 0-element array of its dtype): a lazily loaded
    layer's weights, read once for its visit, are freed; the layer cannot run again."""
    from mlx.utils import tree_map

    layer.update(tree_map(lambda a: mx.zeros((0,), a.dtype), layer.parameters()))
