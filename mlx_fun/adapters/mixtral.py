"""Top-k on raw logits, softmax over the k: mixtral and gpt-oss."""

from __future__ import annotations

import mlx.core as mx

from .base import MoEAdapter, topk_desc, topk_tail


class MixtralAdapter(MoEAdapter):
    model_types = ("mixtral",)
    block_attr = "block_sparse_moe"
    num_experts_key = "num_local_experts"
    select = staticmethod(topk_desc)

    def route(self, block, x, logit_bias=None):
        logits = self.router(block)(x)
        gates = logits if logit_bias is None else logits + logit_bias
        inds = mx.stop_gradient(self.select(gates, self.top_k))
        scores = mx.take_along_axis(gates, inds, axis=-1)
        scores = mx.softmax(scores, axis=-1, precise=True)
        return inds, scores, logits

    def combine(self, block, x, y, weights):
        return (y * weights[..., None]).sum(axis=-2)


class GptOssAdapter(MixtralAdapter):
    """gpt-oss: router with bias, experts ``SwitchGLU(bias=True)`` with the clamped SwiGLU (α 1.702, limit 7)."""

    model_types = ("gpt_oss",)
    block_attr = "mlp"
    experts_attr = "experts"
    router_attr = "router"
    select = staticmethod(topk_tail)
    expert_type = "swiglu_oai"

    def combine(self, block, x, y, weights):
        return (y * mx.expand_dims(weights, axis=-1)).sum(axis=-2)
