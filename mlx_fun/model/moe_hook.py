"""The single hooked MoE call: route (steered) → experts → taps → combine.

``install`` swaps the class of every MoE block for a subclass whose ``__call__`` does the above (Python looks
special methods up on the type, so patching the instance would not work, and wrapping the block in another
module would change the weight keys). ``remove`` restores the original classes. With no steering the hooked call
computes exactly what the block computes: the same routing (the adapter replays it), the block's own
``SwitchGLU`` / ``SwitchMLP`` run once, and the same combine.

Families whose decoder layer calls the router and the experts itself (``adapter.split_router``: gemma4) have no
single block call to swap; there the router module and the experts module are swapped: the hooked router routes
(steered) and hands its routing to the hooked experts call of the same layer, which runs the rest.

A tap is any callable ``tap(layer, inds, weights, logits, y)``: ``layer`` is the position of the block in
``adapter.moe_layers()``, ``inds``/``weights`` are (..., k) (``weights``: each expert's weight in the block output,
``adapter.mixing_weights``), ``logits`` (..., E) raw router logits and ``y`` the
(..., k, D) unweighted expert outputs (in the experts' own space: the latent one where a family projects into
one). Taps must not change their inputs; they keep lazy arrays and let the caller evaluate them together with
the forward pass. A tap that also needs the experts' input defines ``on_input(layer, h)``; it is called with
what the experts are called on (after routing, before the experts run).

A hooked call on at most :data:`COMPILE_MAX_TOKENS` tokens (a decode step, a speculative check, a small serve
batch) runs route → experts → combine as one ``mx.compile``-d graph per block, whose inputs are the block's
weights as they are at each call (``inputs=block``) and the steering arrays: one node where the plain call
launches several (softmax, top-k, renormalisation and the weighted sum fuse), outputs bit for bit those of the
plain call. The graph is traced once per shape, steering scheme, with or without taps, and retraced once anything
is class-swapped (``classswap.epoch``); a family whose routing cannot be traced (it reads a value back on the
host) runs the plain call from its first try on. Taps get the graph's outputs; taps that need the experts' input
(``on_input``), split-router families and larger calls always run the plain call. On the CPU only
(:func:`graph_backend`): under MLX 0.32.4's CUDA backend the same graphs gave other outputs (and, for taps, other
routing weights) than the plain call for 4 of the tiny test families on an H100 (``tests/test_decode_graph.py``),
and Metal is unmeasured.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Sequence

import mlx.core as mx

from ..runtime import blas_threads
from ..core import classswap
from ..errors import UserError
from ..adapters.base import MoEAdapter
from ..adapters.steer import RouteSteer

Tap = Callable[[int, mx.array, mx.array, mx.array, mx.array], None]

_STATE = "_mlxfun_hook"
_TAG = "hook"
#: most tokens a hooked call runs as its compiled graph (decode is 1 per sequence)
COMPILE_MAX_TOKENS = 16


@dataclass
class HookState:
    adapter: MoEAdapter
    layer: int
    block: object = None
    taps: list = field(default_factory=list)
    steer: RouteSteer | None = None
    pending: tuple | None = None  # split_router: (inds, logits) the router handed to the experts call
    compile: bool = False  # small calls run the compiled graph (graph_backend(); off once routing won't trace)
    graphs: dict = field(default_factory=dict)  # (epoch, steering scheme, taps?) -> compiled function


def graph_backend() -> bool:
    """Whether small hooked calls run the compiled graph here: on the CPU (see the module doc)."""
    return mx.default_device() == mx.cpu


def _state(module) -> HookState:
    return classswap.get_state(module, _STATE)


def _experts_and_combine(state: HookState, h, inds, weights, on_input: bool = True):
    """The experts on the routed input ``h`` and the family's combine: ``(out, mixing weights, y)``. Taps that
    also need the experts' input (``on_input``: REAM capture) see it first."""
    adapter, block = state.adapter, state.block
    xe = adapter.expert_input(block, h, inds, weights)
    for tap in state.taps if on_input else ():
        if hasattr(tap, "on_input"):
            tap.on_input(state.layer, xe)
    y = adapter.experts(block)(xe, inds)
    return adapter.combine(block, h, y, weights), adapter.mixing_weights(block, h, weights), y


def _block_call(state: HookState, x, steer, on_input: bool = True):
    """The whole hooked call without taps: ``(out, inds, mixing, logits, y)``."""
    h = state.adapter.prepare(state.block, x)
    inds, weights, logits = state.adapter.route(state.block, h, steer)
    out, mixing, y = _experts_and_combine(state, h, inds, weights, on_input)
    return (out if h is x else out.reshape(x.shape)), inds, mixing, logits, y


def _tapped(state: HookState, out, inds, mixing, logits, y):
    for tap in state.taps:
        tap(state.layer, inds, mixing, logits, y)
    return out


def _hooked_call(self, x):
    state = _state(self)
    tokens = x.size // x.shape[-1]
    blas_threads.call_size(tokens)
    if state.compile and tokens <= COMPILE_MAX_TOKENS:
        out = _compiled_call(state, x)
        if out is not None:
            return out
    return _tapped(state, *_block_call(state, x, state.steer))


def _graph(state: HookState, scheme, taps: bool, x, *steer_arrays):
    """The hooked call as one traced function: ``out`` (and, for taps, ``inds, mixing, logits, y``)."""
    steer = None if scheme is None else RouteSteer(scheme[0], *steer_arrays, eps=scheme[1])
    result = _block_call(state, x, steer, on_input=False)
    return result if taps else result[0]


def _compiled_call(state: HookState, x):
    """The small call through the block's compiled graph; None where it must run plainly (see the module doc)."""
    if any(hasattr(tap, "on_input") for tap in state.taps):
        return None
    steer = state.steer
    scheme = None if steer is None else (steer.scheme, steer.eps)
    key = (classswap.epoch(), scheme, bool(state.taps))
    graph = state.graphs.get(key)
    if graph is None:
        if any(k[0] != key[0] for k in state.graphs):
            state.graphs = {}  # something was swapped since: drop the stale graphs
        fn = mx.compile(partial(_graph, state, scheme, bool(state.taps)), inputs=state.block)
        graph = state.graphs[key] = (fn, set())
    fn, shapes = graph
    args = () if steer is None else (steer.boost, steer.suppress, steer.value)
    if (x.shape, x.dtype) in shapes:
        result = fn(x, *args)
    else:  # this call traces: MLX leaves tracers in the block's weights when a trace raises, so keep them
        weights = state.block.parameters()
        try:
            result = fn(x, *args)
        except (ValueError, RuntimeError):  # routing that evaluates on the host (untraceable): plain calls now
            state.block.update(weights)
            state.compile, state.graphs = False, {}
            return None
        shapes.add((x.shape, x.dtype))
    return _tapped(state, *result) if state.taps else result


def _hooked_router_call(self, x):
    state = _state(self)
    blas_threads.call_size(x.size // x.shape[-1])
    inds, weights, logits = state.adapter.route(state.block, x, state.steer)
    state.pending = (inds, logits)
    return inds, weights


def _hooked_experts_call(self, x, inds, weights):
    state = _state(self)
    pending, state.pending = state.pending, None
    if pending is None or pending[0] is not inds:
        raise RuntimeError(f"MoE layer {state.layer}: the experts were called without their router's routing")
    out, mixing, y = _experts_and_combine(state, x, inds, weights)
    return _tapped(state, out, inds, mixing, pending[1], y)


def _swaps(adapter: MoEAdapter, block) -> list[tuple[object, Callable]]:
    """(module, hooked call) pairs that hook one MoE block."""
    if adapter.split_router:
        return [(adapter.router(block), _hooked_router_call), (adapter.expert_caller(block), _hooked_experts_call)]
    return [(block, _hooked_call)]


def swapped_modules(adapter: MoEAdapter, block) -> list:
    """The modules whose class the hook swaps for ``block``: the block, or its router and experts modules."""
    return [module for module, _ in _swaps(adapter, block)]


def is_hooked(block) -> bool:
    return classswap.get_state(block, _STATE) is not None


def install(
    adapter: MoEAdapter,
    taps: Sequence[Tap] = (),
    steer: dict[int, RouteSteer] | None = None,
) -> list:
    """Hook every MoE block of ``adapter.model``. Returns the blocks (in ``moe_layers`` order).

    ``steer`` maps a block position (index into ``moe_layers()``) to the :class:`RouteSteer` its ``route`` applies
    (``Steering.route_steers`` builds it). Installing on an already hooked model replaces its taps and steering.
    """
    blocks = adapter.blocks()
    for pos, block in enumerate(blocks):
        if getattr(block, "sharding_group", None) is not None:
            raise UserError("tensor-parallel MoE blocks (mlx-lm's shard(): experts split across ranks) are not "
                            "supported by the hooks yet; split the model by layers instead (collect --pipeline under "
                            "mlx.launch), or load it unsharded.")
        state = HookState(adapter, pos, block, list(taps), None if steer is None else steer.get(pos),
                          compile=graph_backend())
        classswap.set_state(block, _STATE, state)
        for module, call in _swaps(adapter, block):
            classswap.set_state(module, _STATE, state)
            classswap.swap(module, _TAG, call, name=f"Hooked{type(module).__name__}")
    return blocks


def remove(adapter: MoEAdapter) -> None:
    """Restore the original class of every hooked MoE block and drop the hook state."""
    for block in adapter.blocks():
        for module, _ in _swaps(adapter, block):
            classswap.restore(module, _TAG)
            classswap.drop_state(module, _STATE)
        classswap.drop_state(block, _STATE)


def for_generation(model, config: dict) -> MoEAdapter | None:
    """Hook ``model`` with no taps and no steering, so that its decode steps run the compiled graph and OpenBLAS one
    thread (smoke-test; steer and serve install hooks of their own): its adapter, or None, with nothing installed,
    where the graph does not run (:func:`graph_backend`) or mlx-fun has no adapter for the family (mlx-lm's own
    call runs)."""
    from ..adapters import get_adapter

    if not graph_backend():
        return None
    try:
        adapter = get_adapter(model, config)
    except UserError:
        return None
    install(adapter)
    return adapter


def set_steer(adapter: MoEAdapter, steer: dict[int, RouteSteer] | None) -> None:
    """Swap the steering of a hooked model in place (no re-install)."""
    for pos, block in enumerate(adapter.blocks()):
        _state(block).steer = None if steer is None else steer.get(pos)


@contextlib.contextmanager
def hooked(adapter: MoEAdapter, taps: Sequence[Tap] = (), steer: dict[int, RouteSteer] | None = None):
    """``with hooked(adapter, taps): model(x)`` — install, run, always remove."""
    install(adapter, taps, steer)
    try:
        yield adapter
    finally:
        remove(adapter)
