"""Qwen-style softmax routers: qwen3_moe, qwen3_next, qwen3_5_moe, qwen2_moe; and olmoe (same router)."""

from __future__ import annotations

import mlx.core as mx

from .base import MoEAdapter, topk_desc, topk_tail
from .steer import selection_order, steered


class _SoftmaxTopK(MoEAdapter):
    """softmax(precise) over all experts, top-k, optionally renormalised."""

    normalise_attr = "norm_topk_prob"
    select = staticmethod(topk_tail)

    def route(self, block, x, steer=None):
        logits = block.gate(x)
        gates = steered(logits, steer)
        probs = mx.softmax(gates, axis=-1, precise=True)
        inds = mx.stop_gradient(self.select(selection_order(probs, gates, steer), self.top_k))
        scores = mx.take_along_axis(probs, inds, axis=-1)
        if self.normalise_attr and getattr(block, self.normalise_attr, False):
            scores = scores / mx.sum(scores, axis=-1, keepdims=True)
        return inds, scores, logits


class Qwen3MoeAdapter(_SoftmaxTopK):
    """qwen3_moe (and qwen3_vl_moe's text model): precise softmax over all experts, top-k (ascending idiom),
    optionally renormalised."""

    model_types = ("qwen3_moe", "qwen3_vl_moe")

    def combine(self, block, x, y, weights):
        return (y * weights[..., None]).sum(axis=-2).astype(y.dtype)


class Qwen3NextAdapter(_SoftmaxTopK):
    """qwen3_next, qwen3_5_moe, qwen3_5 with experts (their text model reuses the Qwen3-Next block): qwen3_moe's
    routing; sigmoid-gated shared expert."""

    model_types = ("qwen3_next", "qwen3_5_moe", "qwen3_5")

    def combine(self, block, x, y, weights):
        y = (y * weights[..., None]).sum(axis=-2)
        shared = mx.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        return y + shared


class Qwen2MoeAdapter(Qwen3NextAdapter):
    """qwen2_moe: precise softmax over all experts, top-k (descending idiom), never renormalised; sigmoid-gated
    shared expert."""

    model_types = ("qwen2_moe",)
    normalise_attr = None
    select = staticmethod(topk_desc)


class OlmoeAdapter(_SoftmaxTopK):
    """olmoe: precise softmax over all experts, top-k (descending idiom), optionally renormalised, on tokens
    flattened to (N, D) (the hooked call reshapes the output back)."""

    model_types = ("olmoe",)
    select = staticmethod(topk_desc)

    def prepare(self, block, x):
        return x.reshape(-1, x.shape[-1])

    def combine(self, block, x, y, weights):
        return (y * weights[..., None]).sum(axis=-2)
