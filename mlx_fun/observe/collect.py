"""Offline calibration: run token batches through a hooked model and accumulate routing statistics.

One forward per batch; the hooks hand each MoE layer's (inds, weights, y) to a ``SaliencyTap``, which keeps the
per-expert output norms lazily; the batch's norms, indices and weights are evaluated together with the forward
pass and fed to the float64 accumulator once per forward (:func:`accumulate`, one ``np.bincount`` per array for
all layers; serve counts its queued forwards through the same function). The final norm and LM head are never
evaluated (only the taps' arrays are), so collect does no work that routing statistics do not need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from ..model import engine, moe_hook
from ..adapters.base import MoEAdapter
from .saliency import SaliencyAccumulator


@dataclass
class Forward:
    """One forward's routing: every MoE layer the tap saw, stacked; lazy until :func:`accumulate` evaluates it."""

    layers: list[int]  # positions in ``moe_layers()``, in the order the rows below hold them
    inds: mx.array  # (len(layers), N, k) over the forward's N flattened token positions
    weights: mx.array  # float32 mixing weights
    norms: mx.array | None  # float32 ‖expert output‖, None: frequency-only
    valid: np.ndarray | None = None  # (N,) bool, the positions that count; None: all of them

    @property
    def positions(self) -> int:
        return self.inds.shape[1]

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.inds, self.weights, self.norms) if a is not None]


def accumulate(acc: SaliencyAccumulator, forwards: Sequence[Forward], evaluate=mx.eval) -> int:
    """Evaluate ``forwards`` together (one ``evaluate`` call) and add each one's valid positions to ``acc`` (one
    :meth:`SaliencyAccumulator.update_layers` per forward); returns the positions counted."""
    evaluate(*[a for f in forwards for a in f.arrays()])
    counted = 0
    for f in forwards:
        inds, w = np.array(f.inds), np.array(f.weights)
        n = None if f.norms is None else np.array(f.norms)
        if f.valid is not None:
            inds, w = inds[:, f.valid], w[:, f.valid]
            n = None if n is None else n[:, f.valid]
        acc.update_layers(inds, w, n, layers=f.layers)
        counted += inds.shape[1]
    return counted


class SaliencyTap:
    """Keeps (layer, inds, weights, norms) of the current forward as lazy arrays.

    ``norms=False`` records frequencies and router weights only (the server's lightweight mode). :meth:`flush`
    counts the forward at once; :meth:`take` hands it over as one :class:`Forward` to count later with
    :func:`accumulate` (serve queues them and counts many at once on its generation thread).
    """

    def __init__(self, norms: bool = True):
        self.norms = norms
        self.pending: list[tuple[int, mx.array, mx.array, mx.array | None]] = []

    def __call__(self, layer, inds, weights, logits, y):
        n = mx.linalg.norm(y.astype(mx.float32), axis=-1) if self.norms else None
        self.pending.append((layer, inds, weights.astype(mx.float32), n))

    def take(self, valid: np.ndarray | None = None) -> Forward | None:
        """What the last forward recorded, as one (lazy) :class:`Forward` with the ``valid`` mask over its token
        positions (any shape, flattened row-major); None when nothing was recorded. The tap starts afresh."""
        pending, self.pending = self.pending, []
        if not pending:
            return None
        k = pending[0][1].shape[-1]

        def stack(j):
            return mx.stack([item[j].reshape(-1, k) for item in pending])

        return Forward([item[0] for item in pending], stack(1), stack(2), stack(3) if self.norms else None,
                       None if valid is None else np.asarray(valid, bool).reshape(-1))

    def flush(self, acc: SaliencyAccumulator, valid: np.ndarray | None = None, evaluate=mx.eval) -> int:
        """Evaluate what the last forward recorded and add it to ``acc``.

        ``valid`` is a boolean mask over the batch's token positions (False for padding); returns the number
        of tokens counted. ``evaluate`` evaluates the arrays (the engine's ``chunk.eval`` adds the KV cache).
        """
        forward = self.take(valid)
        return accumulate(acc, [] if forward is None else [forward], evaluate)


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

    Runs on :func:`mlx_fun.model.engine.run`: length-bucketed batches (right-padded, padding excluded from the
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


def check_streamable(adapter: MoEAdapter, *, run: str, instead: str) -> None:
    """Refuse, in one line (``UserError``), to stream a family whose layers read state other layers hand on
    (``adapter.layerwise_blocker()``): ``run`` names the streamed run, ``instead`` what to do."""
    from ..errors import UserError

    if (blocker := adapter.layerwise_blocker()) is not None:
        raise UserError(f"{run} runs the model one decoder layer at a time, which {adapter.model_type} does not "
                        f"allow: {blocker}; {instead}.")


def collect_streamed(
    model,
    adapter: MoEAdapter,
    samples: Sequence[Sequence[int]],
    *,
    batch_size: int = 1,
    norms: bool = True,
    pad_id: int = 0,
    token_budget: int | None = None,
    progress: bool = False,
    checkpoint=None,
    log=None,
    spill=None,
) -> SaliencyAccumulator:
    """:func:`collect`'s statistics with one decoder layer's weights in memory at a time: the samples' hidden
    states are carried through the layers by :class:`mlx_fun.model.layered.LayerDriver` (the same length-bucketed,
    right-padded batches; a sample is never split), each layer run once through the hooks and then released
    (a lazily loaded model reads each layer's weights from its files for that one visit). Counts equal the
    in-memory run's exactly, sums within float rounding (they are added per layer rather than per forward).

    ``checkpoint`` (:class:`mlx_fun.observe.checkpoint.StreamCheckpoint`): saved after a layer (not the last)
    when it is due (every layer but where layers are quick beside a save: its module docstring), and resumed from
    when it holds a layer (``log`` says where). ``spill``: a directory to carry the hidden states
    in files instead of memory (the driver's ``spill``: the same statistics, bit for bit; removed at the end; the
    checkpoint hard-links the files rather than writing them again). A family whose layers read state other
    layers hand on (``adapter.layerwise_blocker()``) is refused in one line naming ``--pipeline``.
    """
    from ..errors import param
    from ..model.layered import LayerDriver
    from .checkpoint import carried, resume

    check_streamable(adapter, run="a streamed collect", instead=f"collect it without {param('stream_layers')}, or "
                     f"split its layers across machines with {param('pipeline')} under mlx.launch")
    with LayerDriver(model, adapter, samples, batch_size=batch_size, pad_id=pad_id, token_budget=token_budget,
                     spill=spill) as driver:
        last = adapter.moe_layers()[-1]
        start, resumed = resume(checkpoint, driver, layers=last + 1, log=log)
        if resumed is not None:
            acc = resumed.acc
        else:
            acc = SaliencyAccumulator.for_adapter(adapter)
            acc.total_tokens = driver.n_tokens
        tap = SaliencyTap(norms=norms)

        def after_batch(i, batch, out):  # the layer's routing, evaluated with its output, counted at once
            forward = tap.take(None if batch.valid.all() else batch.valid)
            if forward is not None:
                accumulate(acc, [forward], evaluate=lambda *arrays: mx.eval(out, *arrays))
            return ()

        def on_done(i):
            if checkpoint is not None and i < last and checkpoint.due():
                checkpoint.save(i, carried(driver), acc)

        with moe_hook.hooked(adapter, [tap]):
            driver.run(last=last, start=start, release=True, after_batch=after_batch, on_done=on_done,
                       progress=progress, desc="collect")
    return acc
