"""Exact expert counts from live traffic: which tokens a served forward really processed, and their routing.

**What is counted.** A *processed token* is one real token position that goes through the model's MoE layers in a
forward pass: the prompt tokens mlx-lm feeds (those not served from its prompt cache) and every generated token
fed back to compute the next one. Padding that mlx-lm's ``BatchGenerator`` appends to batched prompts of unequal
length is not counted. Each processed token adds exactly ``top_k`` to every MoE layer's ``freq`` row, so per layer
``freq.sum() == top_k × token_count`` always holds.

**How.** :func:`attach` hooks the served model twice: the MoE blocks through :mod:`mlx_fun.model.moe_hook` (the one
hooked call; collect's :class:`~mlx_fun.observe.collect.SaliencyTap` records each layer's lazy ``inds``/weights/norms) and
the model's own ``__call__`` (class swap, tag ``serve``), which brackets each forward: it takes the forward's
valid-position mask and the tap's stacked record of the forward (:meth:`SaliencyTap.take
<mlx_fun.observe.collect.SaliencyTap.take>`), and queues it. Records are turned into numbers later, on the generation
thread, by :meth:`TrafficCounter.flush` through collect's own :func:`~mlx_fun.observe.collect.accumulate` — one
``mx.eval`` for many forwards and one ``np.bincount`` per array and forward — never by
waiting for a forward still running (records older than the newest are flushed during generation and between
the generation loop's iterations; all of them only when a reader waits), so counting does not stall mlx-lm's
asynchronous pipeline.

**Padding.** mlx-lm right-pads batched prompts with ``generate._right_pad_prompts`` (called only when lengths
differ) and then runs the padded array through the model in chunks. :func:`install_padding_probe` wraps that
function to remember the true lengths (thread-local, on the generation thread); the next forwards of that thread
consume them chunk by chunk. Forwards without a record are all real tokens (equal-length prompts, one-token
generation steps, single-sequence ``stream_generate``).

**Speculative decoding.** Only the served model is hooked, so a draft model's forwards (an MoE's too) are never
counted. The served model verifies the drafted tokens in one forward and mlx-lm then trims the ones it rejected
from its KV cache with ``generate.trim_prompt_cache``; :data:`DRAFT_PROBE` wraps that function, and a trim of the
cache the served model's newest forward used drops that forward's last positions from the count
(``draft_rejected``). So with a draft model the counts are those of the tokens the model keeps — its prompt and
its output, as without one — except a response's last token when the model produced it itself (the draft's
tokens are fed back to verify them, the model's own last one never is).

**Snapshots.** The float64 accumulator, the token count and the request count change together under one lock, so
a reader (the HTTP threads) never sees a torn state; :meth:`TrafficCounter.sync` first asks the generation thread
to flush, so a snapshot includes every forward started before it.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import numpy as np

from ..core import classswap
from ..model import moe_hook
from ..adapters.base import MoEAdapter
from ..observe.collect import Forward, SaliencyTap, accumulate
from ..observe.saliency import SaliencyAccumulator

_TAG = "serve"
_STATE = "_mlxfun_serve"
_PADDING = threading.local()
_PROBE_LOCK = threading.Lock()
_PAD_NAME = "_right_pad_prompts"  # mlx_lm.generate's (mlx_lm_compat: serve works around its absence)
#: records kept back during generation before an early flush (bounds memory of long single-sequence requests)
FLUSH_EVERY = 32


@dataclass
class _Queued:
    epoch: int
    forward: Forward  # its valid: (N,) bool, the real (not padding) positions; None: all real
    rejected: int = 0  # last positions the model dropped from its KV cache (drafted tokens it rejected)


class TrafficCounter:
    """Routing statistics of everything the served model processes (see the module docstring)."""

    def __init__(self, adapter: MoEAdapter, *, norms: bool):
        self.adapter = adapter
        self.norms = norms
        self.acc = SaliencyAccumulator.for_adapter(adapter)
        self.lock = threading.Lock()
        self.request_count = 0
        self.padding_skipped = 0
        self.draft_rejected = 0
        self._epoch = 0
        self.tap = SaliencyTap(norms=norms)  # the MoE hook's tap: the current forward's layers (lazy)
        self._valid: np.ndarray | None = None
        self._pending: list[_Queued] = []
        self._sync = threading.Condition()
        self._asked = 0
        self._served = 0

    # ------------------------------------------------------------------ generation thread
    def begin_forward(self, inputs, cache=None) -> None:
        if len(self._pending) > FLUSH_EVERY:  # all but the newest: those are computed already
            self.flush(keep_last=True)
        self.tap.pending = []  # MoE calls outside a bracketed forward are not counted (never happen in serving)
        self._valid = _valid_positions(inputs)
        _PADDING.served = (self, id(cache))  # for the draft probe: a trim of this cache drops this forward's positions

    def reject_last(self, n: int) -> None:
        """The model's KV cache dropped the last ``n`` positions of its newest forward: the drafted tokens it
        rejected in speculative decoding (mlx-lm trims them right after that forward), not counted."""
        if n > 0 and self._pending:
            q = self._pending[-1]
            q.rejected = min(q.rejected + n, q.forward.positions)

    def end_forward(self) -> None:
        forward = self.tap.take(self._valid)
        if forward is None:
            return
        if len(forward.layers) != self.acc.num_layers:
            raise RuntimeError(f"a served forward ran {len(forward.layers)} MoE layers, expected {self.acc.num_layers}")
        self._pending.append(_Queued(self._epoch, forward))

    def flush(self, keep_last: bool = False) -> int:
        """Evaluate queued forwards and add them to the statistics; returns the tokens added."""
        todo = self._pending[:-1] if keep_last else self._pending
        if not todo:
            return 0
        self._pending = self._pending[-1:] if keep_last else []
        with self.lock:
            epoch = self._epoch
        live = [q for q in todo if q.epoch == epoch]  # not those recorded before a reset
        delta = SaliencyAccumulator.for_adapter(self.adapter)
        forwards = [dataclasses.replace(q.forward, valid=_kept(q)) if q.rejected else q.forward for q in live]
        tokens = accumulate(delta, forwards) if forwards else 0
        skipped = sum(int((~q.forward.valid).sum()) for q in live if q.forward.valid is not None)
        rejected = sum(q.rejected for q in live)
        with self.lock:
            if self._epoch == epoch:
                delta.total_tokens = tokens
                self.acc.add(delta)
                self.padding_skipped += skipped
                self.draft_rejected += rejected
        return tokens

    def serve_sync(self) -> None:
        """Called by the generation thread between loop iterations. With a reader waiting (:meth:`sync`), flush
        everything and release it; otherwise keep the newest record (its forward may still be running: waiting
        for it would stall mlx-lm's pipeline)."""
        with self._sync:
            asked = self._asked
        self.flush(keep_last=asked == self._served)
        if asked != self._served:
            with self._sync:
                self._served = asked
                self._sync.notify_all()

    # ------------------------------------------------------------------ HTTP threads
    def sync(self, alive, timeout: float = 10.0) -> bool:
        """Ask the generation thread to flush and wait for it (``alive()``: is it still running?)."""
        with self._sync:
            self._asked += 1
            ticket = self._asked
            waited = 0.0
            while self._served < ticket and waited < timeout and alive():
                self._sync.wait(0.05)
                waited += 0.05
            return self._served >= ticket

    def count_request(self) -> None:
        with self.lock:
            self.request_count += 1

    def snapshot(self) -> tuple[SaliencyAccumulator, dict]:
        """A consistent copy of the statistics and the totals."""
        with self.lock:
            acc = SaliencyAccumulator.for_adapter(self.adapter)
            acc.add(self.acc)
            totals = {"request_count": self.request_count, "token_count": self.acc.total_tokens,
                      "padding_skipped": self.padding_skipped, "draft_rejected": self.draft_rejected}
        return acc, totals

    def reset(self) -> dict:
        with self.lock:
            before = {"request_count": self.request_count, "token_count": self.acc.total_tokens}
            self.acc.reset()
            self.request_count = 0
            self.padding_skipped = 0
            self.draft_rejected = 0
            self._epoch += 1
        return before


def _kept(q: _Queued) -> np.ndarray | None:
    """The positions of a recorded forward that count: real (not padding), not rejected; None: all of them."""
    valid = q.forward.valid
    if not q.rejected:
        return valid
    keep = np.ones(q.forward.positions, bool) if valid is None else valid.copy()
    keep[keep.size - q.rejected:] = False
    return keep


def _valid_positions(inputs) -> np.ndarray | None:
    """The forward's real positions (flattened row-major), from the padding probe's record; None: all real."""
    rec = getattr(_PADDING, "record", None)
    shape = getattr(inputs, "shape", ())
    if rec is None or len(shape) != 2:
        return None
    lengths, width, offset = rec
    rows, cols = shape
    if rows != len(lengths):  # not the padded batch (cannot happen between the probe and its forwards)
        _PADDING.record = None
        return None
    pos = np.arange(offset, offset + cols)
    valid = pos[None, :] < np.asarray(lengths)[:, None]
    _PADDING.record = None if offset + cols >= width else (lengths, width, offset + cols)
    return valid.reshape(-1)


class _Probe:
    """The function ``name`` of ``mlx_lm.generate`` (found by ``original()``) replaced by ``wrap(it)`` while any
    server needs it (reference-counted, restored after the last user)."""

    def __init__(self, name: str, original, wrap):
        self.name, self.original, self.wrap, self.users, self.saved = name, original, wrap, 0, None

    def install(self) -> None:
        with _PROBE_LOCK:
            if self.users == 0:
                self.saved = self.original()
                setattr(_generate_module(), self.name, self.wrap(self.saved))
            self.users += 1

    def remove(self) -> None:
        with _PROBE_LOCK:
            self.users -= 1
            if self.users == 0:
                setattr(_generate_module(), self.name, self.saved)


def _pad_function():
    """mlx-lm's ``generate._right_pad_prompts`` through the compat table (None where this mlx-lm lacks it)."""
    from .. import mlx_lm_compat

    return mlx_lm_compat.lookup("mlx_lm.generate", "_right_pad_prompts")


def _probed_padding(original):
    def probed(prompts, max_length=None):
        out = original(prompts, max_length)
        _PADDING.record = ([len(p) for p in prompts], out.shape[1], 0)
        return out

    return probed


def _probed_trim(original):
    def probed(cache, num_tokens):
        served = getattr(_PADDING, "served", None)  # (counter, id of its cache) of this thread's newest forward
        if served is not None and served[1] == id(cache):
            served[0].reject_last(num_tokens)
        return original(cache, num_tokens)

    return probed


#: mlx-lm right-pads batched prompts of unequal length here (the padding is not counted)
PADDING_PROBE = _Probe(_PAD_NAME, _pad_function, _probed_padding)
#: speculative decoding trims the drafted tokens the model rejected from its KV cache here (they are not counted)
DRAFT_PROBE = _Probe("trim_prompt_cache", lambda: _generate_module().trim_prompt_cache, _probed_trim)


def install_padding_probe() -> None:
    """Wrap ``mlx_lm.generate._right_pad_prompts`` so the generation thread knows which positions are padding."""
    PADDING_PROBE.install()


def remove_padding_probe() -> None:
    PADDING_PROBE.remove()


def padding_probe_supported() -> bool:
    """True when this mlx-lm pads batched prompts the way the probe expects (``_right_pad_prompts``, called by
    ``PromptProcessingBatch.prompt``); otherwise serve prefills one prompt at a time."""
    prompt = getattr(getattr(_generate_module(), "PromptProcessingBatch", None), "prompt", None)
    return _pad_function() is not None and prompt is not None and _PAD_NAME in prompt.__code__.co_names


def _generate_module():
    """``mlx_lm.generate`` the module (``mlx_lm.generate`` the attribute is the function of that name)."""
    import importlib

    return importlib.import_module("mlx_lm.generate")


# ---------------------------------------------------------------------------------------- the model hook
def _served_call(self, inputs, *args, **kwargs):
    counter: TrafficCounter = classswap.get_state(self, _STATE)
    counter.begin_forward(inputs, kwargs.get("cache", args[0] if args else None))
    try:
        return classswap.original_class(self, _TAG).__call__(self, inputs, *args, **kwargs)
    finally:
        counter.end_forward()


def attach(model, counter: TrafficCounter) -> None:
    """Hook ``model`` (already loaded, on the generation thread) so every forward is counted by ``counter``."""
    moe_hook.install(counter.adapter, [counter.tap])
    classswap.set_state(model, _STATE, counter)
    classswap.swap(model, _TAG, _served_call, name=f"Served{type(model).__name__}")


def detach(model, counter: TrafficCounter) -> None:
    moe_hook.remove(counter.adapter)
    classswap.restore(model, _TAG)
    classswap.drop_state(model, _STATE)
