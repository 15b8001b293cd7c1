"""The single hooked MoE call: route → (bias) → experts → taps → combine.

``install`` swaps the class of every MoE block for a subclass whose ``__call__`` does the above (Python looks
special methods up on the type, so patching the instance would not work, and wrapping the block in another
module would change the weight keys). ``remove`` restores the original classes. With no bias the hooked call
computes exactly what the block computes: the same routing (the adapter replays it), the block's own
``SwitchGLU`` run once, and the same combine.

A tap is any callable ``tap(layer, inds, weights, logits, y)``: ``layer`` is the position of the block in
``adapter.moe_layers()``, ``inds``/``weights`` are (..., k), ``logits`` (..., E) raw router logits and ``y`` the
(..., k, D) unweighted expert outputs. Taps must not change their inputs; they keep lazy arrays and let the
caller evaluate them together with the forward pass. A tap that also needs the block's input defines
``on_input(layer, h)``; it is called with the prepared input (what router and experts see) before routing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import mlx.core as mx

from . import classswap
from .adapters.base import MoEAdapter

Tap = Callable[[int, mx.array, mx.array, mx.array, mx.array], None]

_STATE = "_mlxfun_hook"
_TAG = "hook"


@dataclass
class HookState:
    adapter: MoEAdapter
    layer: int
    taps: list = field(default_factory=list)
    bias: mx.array | None = None


def _hooked_call(self, x):
    state: HookState = object.__getattribute__(self, _STATE)
    adapter = state.adapter
    h = adapter.prepare(self, x)
    for tap in state.taps:
        on_input = getattr(tap, "on_input", None)
        if on_input is not None:  # taps that also need the block's input (REAM capture)
            on_input(state.layer, h)
    inds, weights, logits = adapter.route(self, h, state.bias)
    y = adapter.experts(self)(h, inds)
    for tap in state.taps:
        tap(state.layer, inds, weights, logits, y)
    out = adapter.combine(self, h, y, weights)
    return out if h is x else out.reshape(x.shape)


def is_hooked(block) -> bool:
    return classswap.is_swapped(block, _TAG)


def install(
    adapter: MoEAdapter,
    taps: Sequence[Tap] = (),
    bias: dict[int, mx.array] | None = None,
) -> list:
    """Hook every MoE block of ``adapter.model``. Returns the blocks (in ``moe_layers`` order).

    ``bias`` maps a block position (index into ``moe_layers()``) to an (E,) logit bias added before selection.
    Installing on an already hooked model replaces its taps and bias.
    """
    blocks = adapter.blocks()
    for pos, block in enumerate(blocks):
        if getattr(block, "sharding_group", None) is not None:
            raise ValueError("sharded (distributed) MoE blocks are not supported by the hooks; load unsharded")
        state = HookState(adapter, pos, list(taps), None if bias is None else bias.get(pos))
        classswap.set_state(block, _STATE, state)
        classswap.swap(block, _TAG, _hooked_call, name=f"Hooked{type(block).__name__}")
    return blocks


def remove(adapter: MoEAdapter) -> None:
    """Restore the original class of every hooked MoE block and drop the hook state."""
    for block in adapter.blocks():
        classswap.restore(block, _TAG)
        classswap.drop_state(block, _STATE)


def set_bias(adapter: MoEAdapter, bias: dict[int, mx.array] | None) -> None:
    """Swap the logit biases of a hooked model in place (no re-install)."""
    for pos, block in enumerate(adapter.blocks()):
        object.__getattribute__(block, _STATE).bias = None if bias is None else bias.get(pos)


@contextlib.contextmanager
def hooked(adapter: MoEAdapter, taps: Sequence[Tap] = (), bias: dict[int, mx.array] | None = None):
    """``with hooked(adapter, taps): model(x)`` — install, run, always remove."""
    install(adapter, taps, bias)
    try:
        yield adapter
    finally:
        remove(adapter)
