"""step3p5 (Step-3.5): sigmoid router with a selection-only ``router_bias``, renormalised and scaled; SwiGLU
experts clamped per layer (``swiglu_limits``); an always-on shared expert.

Selection runs the model module's own compiled ``moe_gate_select`` on the (biased) logits, as the block does.
"""

from __future__ import annotations

import mlx.core as mx

from .base import MoEAdapter, model_function
from .steer import steered, steered_correction


class Step3p5Adapter(MoEAdapter):
    """step3p5: sigmoid scores, selection-only ``router_bias``, renormalised and scaled; SwiGLU experts clamped per
    layer; shared expert."""

    model_types = ("step3p5",)
    num_experts_key = "moe_num_experts"
    top_k_key = "moe_top_k"

    @property
    def expert_type(self) -> str:  # type: ignore[override]
        return "swiglu_clamped" if any(self.text_config.get("swiglu_limits") or []) else "swiglu"

    def expert_params(self, block) -> dict:
        layer = self.moe_layers()[self.blocks().index(block)]
        limits = self.text_config.get("swiglu_limits") or []
        return {"limit": float(limits[layer] or 0) if layer < len(limits) else 0.0}

    def _is_moe(self, block) -> bool:
        return block is not None and hasattr(block, "switch_mlp")

    def route(self, block, x, steer=None):
        gate = block.gate
        select = model_function(gate, "moe_gate_select")
        logits = gate.gate(x)
        gates = steered(logits, steer)
        bias = steered_correction(gate.router_bias, steer, lambda: mx.sigmoid(gates.astype(mx.float32)))
        inds, weights = select(gates, bias, gate.top_k, gate.routed_scaling_factor, gate.norm_topk_prob)
        return inds, weights, logits

    def combine(self, block, x, y, weights):
        return (y * weights[..., None]).sum(axis=-2).astype(y.dtype) + block.share_expert(x)
