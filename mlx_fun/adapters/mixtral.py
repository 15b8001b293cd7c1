"""Top-k on raw logits, softmax over the k: mixtral, gpt-oss, phixtral; and llama4's top-1 sigmoid router."""

from __future__ import annotations

import mlx.core as mx

from .base import MoEAdapter, topk_desc, topk_tail
from .steer import steered


class MixtralAdapter(MoEAdapter):
    """mixtral: top-k (descending idiom) on raw logits, softmax over the k."""

    model_types = ("mixtral",)
    block_attr = "block_sparse_moe"
    num_experts_key = "num_local_experts"
    select = staticmethod(topk_desc)

    def route(self, block, x, steer=None):
        logits = self.router(block)(x)
        gates = steered(logits, steer)
        inds = mx.stop_gradient(self.select(gates, self.top_k))
        scores = mx.take_along_axis(gates, inds, axis=-1)
        scores = mx.softmax(scores, axis=-1, precise=True)
        return inds, scores, logits

    def combine(self, block, x, y, weights):
        return (y * weights[..., None]).sum(axis=-2)


class GptOssAdapter(MixtralAdapter):
    """gpt_oss: router with bias, top-k (ascending idiom), softmax over the k; experts ``SwitchGLU(bias=True)`` with the clamped SwiGLU (α 1.702, limit 7)."""

    model_types = ("gpt_oss",)
    block_attr = "mlp"
    experts_attr = "experts"
    router_attr = "router"
    select = staticmethod(topk_tail)
    expert_type = "swiglu_oai"

    def combine(self, block, x, y, weights):
        return (y * mx.expand_dims(weights, axis=-1)).sum(axis=-2)


class PhixtralAdapter(MixtralAdapter):
    """phixtral (``phi-msft``): mixtral's router over a GELU ``SwitchMLP`` with biases (``fc1``/``fc2``)."""

    model_types = ("phixtral",)
    block_attr = "moe"
    expert_type = "gelu_mlp"
    hidden_size_key = "model_dim"


class Llama4Adapter(MoEAdapter):
    """llama4: top-1 (or top-k) on raw logits, sigmoid of the chosen logits scales the experts' *input*
    (``experts(x * score)``); an always-on shared expert."""

    model_types = ("llama4",)
    block_attr = "feed_forward"
    experts_attr = "experts"
    router_attr = "router"
    num_experts_key = "num_local_experts"
    weights_at_input = True

    def _is_moe(self, block) -> bool:
        return block is not None and hasattr(block, "router")

    def route(self, block, x, steer=None):
        logits = block.router(x)
        gates = steered(logits, steer)
        inds = mx.stop_gradient(topk_desc(gates, block.top_k))
        scores = mx.take_along_axis(gates, inds, axis=-1)
        scores = mx.sigmoid(scores.astype(mx.float32)).astype(x.dtype)
        return inds, scores, logits

    def expert_input(self, block, x, inds, weights):
        return x * weights

    def combine(self, block, x, y, weights):
        return y.squeeze(2) + block.shared_expert(x)
