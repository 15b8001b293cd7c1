"""deepseek_v41 (DeepSeek-V4.1): float32 router with a temperature and sigmoid / softmax / sqrt-softplus scores,
a selection-only correction bias, renormalised and scaled; SwiGLU experts clamped before the activation
(``silu(min(g, L)) · clip(u, ±L)`` in float32); an always-on shared expert; tokens flattened to (N, D).

Routing, hooks, collect and prune are exact. Its decoder layers pass hyper-connection state (``streams``,
``pre_mix``) from layer to layer and write their KV cache on every call, so merge's layer-by-layer driver
cannot replay a layer: merge refuses it in one line (``layerwise_reason``).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .base import MoEAdapter
from .steer import steered, steered_selection


class DeepSeekV41Adapter(MoEAdapter):
    """deepseek_v41: float32 router / temperature, sigmoid, softmax or sqrt-softplus scores, selection-only
    correction bias, renormalised and scaled; pre-clamped SwiGLU experts; shared expert; flattened tokens."""

    model_types = ("deepseek_v41",)
    experts_attr = "experts"
    num_experts_key = "n_routed_experts"
    expert_type = "swiglu_preclamp"
    layerwise_reason = (
        "its decoder layers pass hyper-connection state (streams, pre_mix) and write their KV cache on every call"
    )

    def _is_moe(self, block) -> bool:
        return block is not None and hasattr(block, "experts") and hasattr(block, "gate")

    def experts(self, block):
        return block.experts.switch_mlp

    def expert_params(self, block) -> dict:
        return {"limit": float(self.text_config.get("swiglu_limit") or 0.0)}

    def prepare(self, block, x):
        return x.reshape(-1, block.dim)

    def route(self, block, x, steer=None):
        gate = block.gate
        logits = x.astype(mx.float32) @ gate.weight.astype(mx.float32).T
        scaled = steered(logits / gate.gate_temp, steer)
        if gate.score_func == "sigmoid":
            scores = mx.sigmoid(scaled)
        elif gate.score_func == "softmax":
            scores = mx.softmax(scaled, axis=-1)
        else:
            scores = mx.sqrt(nn.softplus(scaled))
        biased = steered_selection(scores + gate.e_score_correction_bias, steer)
        chosen = mx.argpartition(-biased, gate.top_k - 1, axis=-1)[..., : gate.top_k]
        weights = mx.take_along_axis(scores, chosen, axis=-1)
        if gate.norm_topk_prob and gate.top_k > 1:
            weights = weights / (mx.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return chosen, weights * gate.route_scale, logits

    def combine(self, block, x, y, weights):
        routed = mx.sum(y.astype(mx.float32) * weights[..., None].astype(mx.float32), axis=1)
        out = routed + block.shared_experts(x).astype(mx.float32)
        return out.astype(x.dtype)
