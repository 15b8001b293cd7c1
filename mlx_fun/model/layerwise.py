"""Run an mlx-lm model one decoder layer at a time, with the exact arguments its own forward gives each layer.

Every mlx-lm model builds the per-layer arguments (attention masks, caches) inside its inner ``__call__``, and
families differ: gpt-oss alternates full and sliding-window masks, qwen3-next / qwen3.5 hand linear-attention
layers an SSM mask and full-attention layers a causal one, DeepSeek-style models pass an array mask, dense
first layers sit before MoE layers. Rather than re-deriving that per family, :func:`record_layer_calls` runs
the model's own forward once with every decoder layer swapped for a recorder that keeps ``(args, kwargs)``
and returns its input unchanged. The embeddings and mask construction are the only work done (the LM head is
built lazily and never evaluated). Afterwards :func:`run_layer` calls layer ``i`` on any hidden state with
the recorded arguments, so ``h_{i+1} = layer_i(h_i, *args_i, **kwargs_i)`` is exactly the step the model's
own loop takes; chaining it over all layers gives the model's last hidden state (a test checks this for
every family).

:func:`final_logits` closes the loop: it runs the model's forward again with the layers swapped for
"return this hidden state" stand-ins, so the model's own final norm and LM head produce the logits of a
hidden state computed layer by layer.

Most decoder layers return their hidden state; gemma4's return ``(h, shared_kv, offset)``. The stand-ins return
what the adapter's ``layer_passthrough(x, *args, **kwargs)`` builds from their call (``x`` itself by default), and
:func:`run_layer` hands back the hidden state of whatever the layer returns.

Layer swapping changes the class of the layer object (Python looks ``__call__`` up on the type), exactly like
``moe_hook`` does for MoE blocks; the original class is always restored.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from ..core import classswap

_FN = "_mlxfun_layer_fn"
_TAG = "layerwise"


def _swapped_call(self, *args, **kwargs):
    return classswap.get_state(self, _FN)(*args, **kwargs)


@contextlib.contextmanager
def swap_layer_calls(layers: list, make_fn: Callable[[int], Callable]):
    """Within the block, calling ``layers[i]`` calls ``make_fn(i)(*args, **kwargs)`` instead."""
    try:
        for i, layer in enumerate(layers):
            classswap.set_state(layer, _FN, make_fn(i))
            classswap.swap(layer, _TAG, _swapped_call)
        yield
    finally:
        for layer in layers:
            classswap.restore(layer, _TAG)
            classswap.drop_state(layer, _FN)


@dataclass
class LayerCalls:
    """The input of the first decoder layer and the extra arguments the model hands every layer."""

    h: mx.array
    args: list[tuple] = field(default_factory=list)
    kwargs: list[dict] = field(default_factory=list)


def _identity(x, *args, **kwargs):
    return x


def record_layer_calls(model, layers: list, tokens: mx.array, passthrough: Callable = _identity) -> LayerCalls:
    """Run ``model(tokens)`` with identity layers; return the first layer's input and every layer's arguments.

    ``layers`` are the model's decoder layers in forward order (``adapter.decoder_layers()``); a stand-in layer
    returns ``passthrough(x, *args, **kwargs)`` (``adapter.layer_passthrough``).
    """
    n = len(layers)
    rec_args: list = [None] * n
    rec_kwargs: list = [None] * n
    first: list = [None]

    def make(i):
        def fn(x, *args, **kwargs):
            rec_args[i], rec_kwargs[i] = args, kwargs
            if first[0] is None:
                first[0] = x
            return passthrough(x, *args, **kwargs)

        return fn

    with swap_layer_calls(layers, make):
        model(tokens)  # lazy: only the recorded embeddings / masks are ever evaluated
    missing = [i for i in range(n) if rec_args[i] is None]
    if missing or first[0] is None:
        raise RuntimeError(f"the model's forward did not call decoder layer(s) {missing}; cannot run it layer by layer")
    return LayerCalls(first[0], list(rec_args), list(rec_kwargs))


def hidden(out) -> mx.array:
    """The hidden state of a decoder layer's output (the first item of a tuple output)."""
    return out[0] if isinstance(out, tuple) else out


def run_layer(layer, h: mx.array, calls: LayerCalls, i: int) -> mx.array:
    """Layer ``i`` applied to ``h`` with the arguments the model's own forward gives it; its hidden state."""
    return hidden(layer(h, *calls.args[i], **calls.kwargs[i]))


def run_layers(model, layers: list, tokens: mx.array, passthrough: Callable = _identity) -> mx.array:
    """The last decoder layer's output of ``model(tokens)``, computed one layer at a time (evaluated per layer)."""
    calls = record_layer_calls(model, layers, tokens, passthrough)
    h = calls.h
    for i, layer in enumerate(layers):
        h = run_layer(layer, h, calls, i)
        mx.eval(h)
    return h


def final_logits(model, layers: list, tokens: mx.array, h: mx.array, passthrough: Callable = _identity) -> mx.array:
    """The model's logits when its last decoder layer outputs ``h`` (final norm and LM head of the model itself)."""
    last = len(layers) - 1
    with swap_layer_calls(layers, lambda i: (lambda x, *a, **k: passthrough(h if i == last else x, *a, **k))):
        return model(tokens)
