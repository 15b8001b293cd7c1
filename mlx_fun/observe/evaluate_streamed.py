"""``eval --stream-layers``: :func:`mlx_fun.observe.evaluate.evaluate`'s numbers with one decoder layer's weights
in memory at a time (per model).

Every dataset's samples are batched as the in-memory eval batches them (each fed without its last token,
length-bucketed, right-padded, split by rows to the token budget; a sample is never split into chunks) and carried
through the decoder layers by :class:`mlx_fun.model.layered.LayerDriver`, one driver per dataset and model. The
layers are visited once, in order: at layer ``i`` every driver of the model is stepped, then the layer's weights
are released (a lazily loaded model reads each layer from its files for that one visit); a reference is stepped
beside the model at the same layer (lockstep: both models' hidden states are carried layer by layer). After the
last layer each batch's logits come from the model's own final norm and LM head
(:func:`mlx_fun.model.layerwise.final_logits`) and are scored exactly as the in-memory eval scores a forward
(:func:`mlx_fun.observe.evaluate.score_chunk`). Token counts equal the in-memory eval's exactly, the means within
float rounding. ``spill``: the drivers carry their hidden states in files in a directory each under it (see
:class:`~mlx_fun.model.layered.LayerDriver`), removed at the end. ``checkpoint``: every driver's hidden states saved
after a layer when due (:class:`mlx_fun.observe.checkpoint.StreamCheckpoint`), and resumed from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..adapters.base import MoEAdapter
from ..errors import UserError, param
from .evaluate import DEFAULT_BATCH_SIZE, Sums, check_batch_size, score_chunk, summary


def evaluate_streamed(
    model,
    adapter: MoEAdapter,
    samples_by_name: Mapping[str, Sequence[Sequence[int]]],
    reference=None,
    ref_adapter: MoEAdapter | None = None,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    pad_id: int = 0,
    token_budget: int | None = None,
    progress: bool = False,
    spill=None,
    checkpoint=None,
    log=None,
) -> dict[str, dict[str, Any]]:
    """:func:`mlx_fun.observe.evaluate.evaluate`'s results (per dataset name: samples, tokens, nll, ppl and, with
    ``reference``, ref_nll, ref_ppl, kl, top1_agreement), the models streamed one decoder layer at a time (see
    the module docstring); ``reference`` needs its adapter, ``ref_adapter``; ``spill``: a directory to carry the
    hidden states in files instead of memory (one folder per driver in it; all removed at the end, the directory
    too when it is left empty); ``checkpoint``: resumed from when it holds a layer (``log`` says where), saved after
    a layer when due. A family whose layers read state other layers hand on (``adapter.layerwise_blocker()``) is
    refused in one line."""
    from ..model import engine
    from ..model.layered import LayerDriver

    check_batch_size(batch_size)
    two = reference is not None and reference is not model  # the reference runs beside the model
    streams = [(model, adapter)] + ([(reference, ref_adapter)] if two else [])
    for _, a in streams:
        if (blocker := a.layerwise_blocker()) is not None:
            raise UserError(f"a streamed eval runs the model one decoder layer at a time, which {a.model_type} does "
                            f"not allow: {blocker}; evaluate it without {param('stream_layers')}.")
    full = {name: [np.asarray(s, dtype=np.int64).reshape(-1) for s in samples if len(s) >= 2]
            for name, samples in samples_by_name.items()}
    results: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        if spill is not None:
            stack.callback(_remove_if_empty, Path(spill))  # last: after every driver has removed its own folder

        def driver(k: int, m, a, samples) -> LayerDriver:
            where = None if spill is None else Path(spill) / f"driver-{k}"
            return stack.enter_context(LayerDriver(m, a, samples, batch_size=batch_size, pad_id=pad_id,
                                                   token_budget=token_budget, spill=where))

        drivers = {name: [driver(n * len(streams) + j, m, a, [s[:-1] for s in full[name]])
                          for j, (m, a) in enumerate(streams)] for n, name in enumerate(full)}
        if any(d.batches for ds in drivers.values() for d in ds):
            _carry([(a, [ds[j] for ds in drivers.values()]) for j, (_, a) in enumerate(streams)], progress,
                   checkpoint=checkpoint, log=log)
        for name, samples in samples_by_name.items():
            sums = Sums()
            for batches in zip(*(d.batches for d in drivers[name])):
                b = batches[0]
                chunk = engine.Chunk(b.tokens, b.valid.sum(axis=1), 0, b.rows, None,
                                     engine.next_tokens(full[name], b.rows, b.tokens.shape, pad_id))
                logits = [_logits(m, a, lb) for (m, a), lb in zip(streams, batches)]
                score_chunk(logits[0], chunk, sums,
                            (logits[1] if two else logits[0]) if reference is not None else None)
            results[name] = summary(samples, sums, reference is not None)
    return results


def _remove_if_empty(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.rmdir()


def _carry(streams: list[tuple[MoEAdapter, list]], progress: bool, *, checkpoint=None, log=None) -> None:
    """Step every driver through its model's decoder layers, the models side by side (layer ``i`` of each, then
    ``i + 1``), each layer released once all its model's drivers have passed it, the ``checkpoint`` saved after a
    layer when due (every driver's hidden states, in ``streams`` order: :func:`mlx_fun.observe.checkpoint.carried`)
    and resumed from (:func:`mlx_fun.observe.checkpoint.resume`: ``log`` says where); the last hidden states stay."""
    from ..model.layered import release_layer
    from .checkpoint import carried, resume

    depth = max(len(a.decoder_layers()) for a, _ in streams)
    every = [d for _, drivers in streams for d in drivers]
    start, _ = resume(checkpoint, every, layers=depth, log=log)
    bar = None
    if progress:
        from tqdm import tqdm

        tokens = sum(d.n_tokens for d in every)
        bar = tqdm(total=depth, initial=start, unit="layer", desc="eval", dynamic_ncols=True,
                   postfix=f"{tokens:,} tokens a layer")
    try:
        for i in range(start, depth):
            for adapter, drivers in streams:
                layers = adapter.decoder_layers()
                if i < len(layers):
                    for d in drivers:
                        d.step(i)
                    release_layer(layers[i])
            if checkpoint is not None and i < depth - 1 and checkpoint.due():
                checkpoint.save(i, carried(every))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def _logits(model, adapter: MoEAdapter, batch) -> mx.array:
    """The batch's logits from its last hidden state (the model's final norm and LM head); the state is dropped."""
    from ..model import layerwise

    h, batch.h = batch.h, None
    return layerwise.final_logits(model, adapter.decoder_layers(), mx.array(batch.tokens), h,
                                  adapter.layer_passthrough)
