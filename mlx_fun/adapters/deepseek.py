"""DeepSeek-style MoEGate routers: deepseek_v3 (kimi_k2, kimi_k25), deepseek_v32, glm4_moe, glm4_moe_lite,
glm_moe_dsa, dots1.

Sigmoid scores plus a selection-only correction bias, group-limited top-k when n_group > 1, optional
renormalisation and a routed scaling factor. Selection calls the ``group_expert_select`` of the very module
that defines the block's gate, so it is the same compiled function the block runs.
"""

from __future__ import annotations

import mlx.core as mx

from .base import MoEAdapter, model_function
from .steer import steered, steered_correction


class DeepSeekAdapter(MoEAdapter):
    """DeepSeek-V3 MoEGate: sigmoid scores, selection-only correction bias, group-limited top-k (n_group), optional
    renormalisation, routed scaling; shared experts."""

    model_types = (
        "deepseek_v3",
        "kimi_k2",
        "kimi_k25",
        "deepseek_v32",
        "glm4_moe",
        "glm4_moe_lite",
        "glm_moe_dsa",
        "dots1",
        "solar_open",
        "kimi_vl",
    )
    num_experts_key = "n_routed_experts"
    group_keys = ("n_group", "topk_group")

    def _is_moe(self, block) -> bool:
        if block is None:
            return False
        # dots1 names its SwitchGLU `experts`; the others `switch_mlp`
        return hasattr(block, "switch_mlp") or (hasattr(block, "experts") and hasattr(block, "gate"))

    def experts(self, block):
        return block.switch_mlp if hasattr(block, "switch_mlp") else block.experts

    @property
    def experts_attr(self) -> str:  # type: ignore[override]
        return "switch_mlp" if hasattr(self.block(self._moe_layers[0]), "switch_mlp") else "experts"


    def route(self, block, x, steer=None):
        gate = block.gate
        select = model_function(gate, "group_expert_select")
        logits = x @ gate.weight.T
        gates = steered(logits, steer)
        inds, scores = select(
            gates,
            steered_correction(gate.e_score_correction_bias, steer, lambda: mx.sigmoid(gates.astype(mx.float32))),
            gate.top_k,
            gate.n_group,
            gate.topk_group,
            gate.routed_scaling_factor,
            gate.norm_topk_prob,
        )
        return inds, scores, logits

    def combine(self, block, x, y, weights):
        y = (y * weights[..., None]).sum(axis=-2).astype(y.dtype)
        if getattr(block, "shared_experts", None) is not None:
            y = y + block.shared_experts(x)
        return y
