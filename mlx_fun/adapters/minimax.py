"""MiniMax (and MiniMax-M2, which mlx-lm maps onto it) and MiniMax-M3: sigmoid routers with a selection-only correction bias."""

from __future__ import annotations

import mlx.core as mx

from .base import MoEAdapter, topk_desc
from .steer import steered, steered_selection


class MiniMaxAdapter(MoEAdapter):
    """minimax: sigmoid scores on float32 input, the block's ``e_score_correction_bias`` only for selection, weights
    renormalised (+1e-20)."""

    model_types = ("minimax", "minimax_m2")
    block_attr = "block_sparse_moe"
    num_experts_key = "num_local_experts"
    extra_expert_params = ("e_score_correction_bias",)

    def route(self, block, x, steer=None):
        logits = block.gate(x.astype(mx.float32))
        gates = steered(logits, steer)
        scores = mx.sigmoid(gates)
        orig_scores = scores
        scores = steered_selection(scores + block.e_score_correction_bias, steer)
        inds = mx.stop_gradient(topk_desc(scores, self.top_k))
        scores = mx.take_along_axis(orig_scores, inds, axis=-1)
        scores = scores / (mx.sum(scores, axis=-1, keepdims=True) + 1e-20)
        return inds, scores.astype(x.dtype), logits

    def combine(self, block, x, y, weights):
        return (y * weights[..., None]).sum(axis=-2)


class MiniMaxM3Adapter(MoEAdapter):
    """minimax_m3_vl (text model): MiniMax's sigmoid + correction-bias router on flattened tokens, renormalised
    and scaled; gpt-oss-style clamped SwiGLU experts without biases; an always-on shared expert."""

    model_types = ("minimax_m3_vl",)
    block_attr = "block_sparse_moe"
    num_experts_key = "num_local_experts"
    extra_expert_params = ("e_score_correction_bias",)
    expert_type = "swiglu_oai"

    def expert_params(self, block) -> dict:
        return {"alpha": float(self.text_config.get("swiglu_alpha", 1.702)),
                "limit": float(self.text_config.get("swiglu_limit", 7.0))}

    def prepare(self, block, x):
        return x.reshape(-1, x.shape[-1])

    def route(self, block, x, steer=None):
        logits = block.gate(x)
        gates = steered(logits, steer)
        scores = mx.sigmoid(gates.astype(mx.float32))
        orig_scores = scores
        scores = steered_selection(scores + block.e_score_correction_bias, steer)
        inds = mx.stop_gradient(topk_desc(scores, self.top_k))
        scores = mx.take_along_axis(orig_scores, inds, axis=-1)
        scores = scores / (mx.sum(scores, axis=-1, keepdims=True) + 1e-20)
        scores = (scores * block.routed_scaling_factor).astype(x.dtype)
        return inds, scores, logits

    def combine(self, block, x, y, weights):
        return (y * weights[..., None]).sum(axis=-2) + block.shared_experts(x)
