"""The residual stream per decoder layer, averaged over a dataset: what abliteration's refusal directions come from.

:func:`capture` runs the samples through the forward engine (length-bucketed batches, the token budget, long
samples in chunks through the KV cache) with every decoder layer's call wrapped to keep its output hidden state,
the residual stream after that layer, and accumulates per layer, in float64, either the hidden state at each
sample's **last** real token (``position="last"``: where a chat prompt ends, right before the reply) or the
**mean** over its real tokens (``"mean"``: each sample weighs the same). Padding is never read. One forward per
batch; only the per-layer sums are kept. :func:`capture_streamed` gives the same means with one decoder layer's
weights in memory at a time (a streamed ``abliterate``).

:func:`directions` turns the harmful and benign means into per-layer unit directions
``normalise(mean_harmful − mean_benign)`` and keeps the un-normalised norms (what ``--layers auto`` ranks by).
"""

from __future__ import annotations

import math
from typing import Sequence

import mlx.core as mx
import numpy as np

from ..model import engine, layerwise
from ..errors import UserError

POSITIONS = ("last", "mean")


def capture(model, adapter, samples: Sequence[Sequence[int]], *, position: str = "last", batch_size: int = 4,
            pad_id: int = 0, budget: int | None = None, progress: bool = False, desc: str = "residual") -> np.ndarray:
    """(decoder layers, hidden) float64 mean residual stream after every decoder layer over ``samples``."""
    if position not in POSITIONS:
        raise ValueError(f"position must be one of {POSITIONS}, got {position!r}")
    layers = adapter.decoder_layers()
    outs: list = [None] * len(layers)

    def make(i):
        layer = layers[i]
        call = type(layer).__call__  # the layer's own call (taken before the swap)

        def fn(x, *args, **kwargs):
            out = call(layer, x, *args, **kwargs)
            outs[i] = layerwise.hidden(out)
            return out

        return fn

    sums = np.zeros((len(layers), adapter.hidden_size), dtype=np.float64)

    def on_chunk(chunk, _out):
        valid = chunk.valid
        for i, o in enumerate(outs):
            _check_residual(adapter, i, o, sums.shape[1])
        if position == "last":
            pick = (chunk.lengths - 1 - chunk.start)
            rows = np.flatnonzero((pick >= 0) & (pick < valid.shape[1]))
            if len(rows) == 0:
                chunk.eval(*[o for o in outs if o is not None])
                return
            idx_b, idx_t = mx.array(rows), mx.array(pick[rows])
            picked = [o[idx_b, idx_t].astype(mx.float32) for o in outs]
            chunk.eval(*picked)
            for i, p in enumerate(picked):
                sums[i] += np.asarray(p, dtype=np.float64).sum(axis=0)
        else:  # each sample weighs the same: its real tokens weigh 1 / its length
            w = valid / np.maximum(chunk.lengths, 1)[:, None]
            wm = mx.array(w.astype(np.float32))[..., None]
            pooled = [(o.astype(mx.float32) * wm).sum(axis=(0, 1)) for o in outs]
            chunk.eval(*pooled)
            for i, p in enumerate(pooled):
                sums[i] += np.asarray(p, dtype=np.float64)
        for i in range(len(outs)):
            outs[i] = None

    with layerwise.swap_layer_calls(layers, make):
        engine.run(model, samples, on_chunk, batch_size=batch_size, pad_id=pad_id, budget=budget,
                   progress=progress, desc=desc)
    return sums / max(len(samples), 1)


def _check_residual(adapter, i: int, o, hidden: int) -> None:
    if o.ndim != 3 or o.shape[-1] != hidden:
        raise UserError(f"model_type '{adapter.model_type}': decoder layer {i} hands on a residual state of "
                        f"shape {tuple(o.shape)}, not (batch, tokens, hidden) (several residual streams, "
                        "hyper-connections); one refusal direction per layer is not defined for it.")


def capture_streamed(model, adapter, samples: Sequence[Sequence[int]], *, load, position: str = "last",
                     batch_size: int = 4, pad_id: int = 0, budget: int | None = None, progress: bool = False,
                     desc: str = "residual") -> np.ndarray:
    """:func:`capture`'s means with one decoder layer's weights in memory at a time: the samples' hidden states are
    carried through the layers by :class:`mlx_fun.model.layered.LayerDriver` (the engine's batches; a sample is
    never split into chunks), ``load(i)`` puts layer ``i``'s weights in before its visit
    (:meth:`mlx_fun.model.layer_files.LayerFiles.load`) and the layer is released after it. Each layer's output is
    read at the same positions and summed in the same order as :func:`capture` reads and sums it."""
    from ..model.layered import LayerDriver

    if position not in POSITIONS:
        raise ValueError(f"position must be one of {POSITIONS}, got {position!r}")
    layers = adapter.decoder_layers()
    sums = np.zeros((len(layers), adapter.hidden_size), dtype=np.float64)
    if not samples:
        return sums
    driver = LayerDriver(model, adapter, samples, batch_size=batch_size, pad_id=pad_id, token_budget=budget)

    def after_batch(i, batch, out):
        _check_residual(adapter, i, out, sums.shape[1])
        lengths = batch.valid.sum(axis=1)
        if position == "last":
            picked = out[mx.array(np.arange(len(lengths))), mx.array(lengths - 1)].astype(mx.float32)
            mx.eval(out, picked)
            sums[i] += np.asarray(picked, dtype=np.float64).sum(axis=0)
        else:
            w = batch.valid / np.maximum(lengths, 1)[:, None]
            pooled = (out.astype(mx.float32) * mx.array(w.astype(np.float32))[..., None]).sum(axis=(0, 1))
            mx.eval(out, pooled)
            sums[i] += np.asarray(pooled, dtype=np.float64)
        return ()

    driver.run(load, last=len(layers) - 1, release=True, after_batch=after_batch, progress=progress, desc=desc)
    return sums / len(samples)


def directions(harmful_mean: np.ndarray, benign_mean: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(unit directions (L, H), un-normalised norms (L,))`` of ``harmful_mean − benign_mean`` per layer."""
    diff = np.asarray(harmful_mean, np.float64) - np.asarray(benign_mean, np.float64)
    norms = np.linalg.norm(diff, axis=1)
    return diff / np.maximum(norms, 1e-30)[:, None], norms


def parse_layers(spec: str, *, where: str = "layers") -> str | tuple[int, int]:
    """``"auto"``, ``"all"`` or the inclusive ``(start, end)`` of a ``start-end`` spec (a single index is a one-layer
    range); a malformed spec raises a one-line :class:`UserError` (no model needed)."""
    text = str(spec).strip().lower()
    if text in ("auto", "all"):
        return text
    parts = text.split("-")
    if len(parts) in (1, 2) and all(p.strip().isdigit() for p in parts):
        a, b = int(parts[0]), int(parts[-1])
        if a > b:
            raise UserError(f"{where} {spec!r}: the range starts after it ends; write start-end, e.g. 1-3.")
        return a, b
    raise UserError(f"{where} {spec!r} is not auto, all or start-end (e.g. 1-3).")


def choose_layers(spec: str, norms: np.ndarray, *, where: str = "layers") -> list[int]:
    """Decoder layers to abliterate: ``auto`` (the top half by un-normalised direction norm), ``all`` or
    ``start-end`` (:func:`parse_layers`), checked against the model's ``len(norms)`` layers."""
    n = len(norms)
    parsed = parse_layers(spec, where=where)
    if parsed == "all":
        return list(range(n))
    if parsed == "auto":
        top = np.argsort(-np.asarray(norms), kind="stable")[: max(1, math.ceil(n / 2))]
        return sorted(int(i) for i in top)
    a, b = parsed
    if b >= n:
        raise UserError(f"{where} {spec!r} is outside the model: it has decoder layers 0-{n - 1}.")
    return list(range(a, b + 1))
