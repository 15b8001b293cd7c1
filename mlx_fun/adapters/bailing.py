"""Bailing (Ling / Ring) routers: bailing_moe, bailing_moe_linear, bailing_moe_v3, bailing_hybrid; and granitemoe,
granitemoehybrid, laguna.

Bailing gates score in float32 (sigmoid or softmax), add a selection-only ``expert_bias``, optionally limit the choice
to ``topk_group`` of ``n_group`` groups, renormalise and scale; a shared expert is added. Where the model file has a
module-level selection function, ``route`` calls that very function (from the module that defines the gate). These
routers keep their ``Linear`` one level down (``gate.gate_proj``, ``router.layer``, ``gate.proj``): ``router_attr``
is that dotted path.
"""

from __future__ import annotations

import mlx.core as mx

from .. import mlx_lm_compat
from .base import MoEAdapter, model_function, topk_desc, topk_tail
from .steer import steered, steered_correction, steered_selection


def _scores(gates, score_function: str):
    """Bailing's float32 scores before the expert bias (what its ``group_expert_select`` computes first)."""
    gates = gates.astype(mx.float32)
    return mx.sigmoid(gates) if score_function == "sigmoid" else mx.softmax(gates, axis=-1)


class _Grouped(MoEAdapter):
    group_keys = ("n_group", "topk_group")


class BailingMoeAdapter(_Grouped):
    """bailing_moe: sigmoid or softmax scores in float32, selection-only ``expert_bias``, group-limited top-k,
    renormalised and scaled (the module's compiled ``group_expert_select`` / ``aggregate_expert_outputs``); shared
    experts."""

    model_types = ("bailing_moe",)
    router_attr = "gate.gate_proj"
    extra_expert_params = ("gate.expert_bias",)

    def route(self, block, x, steer=None):
        gate = block.gate
        select = model_function(gate, "group_expert_select")
        logits = gate.gate_proj(x)
        gates = steered(logits, steer)
        inds, scores = select(
            gates,
            steered_correction(gate.expert_bias, steer, lambda: _scores(gates, gate.score_function)),
            gate.top_k,
            gate.n_group,
            gate.topk_group,
            gate.routed_scaling_factor,
            gate.norm_topk_prob,
            gate.score_function,
        )
        return inds, scores, logits

    def combine(self, block, x, y, weights):
        # looked up through the gate: the block's own class is swapped while hooked
        y = model_function(block.gate, "aggregate_expert_outputs")(y, weights)
        if block.shared_experts is not None:
            y = y + block.shared_experts(x)
        return y


class BailingMoeLinearAdapter(BailingMoeAdapter):
    """bailing_moe_linear: bailing_moe's routing in its own uncompiled ``group_expert_select`` (descending top-k,
    no 1e-20), plain weighted sum; shared experts."""

    model_types = ("bailing_moe_linear",)

    def combine(self, block, x, y, weights):
        y = (y * weights[..., None]).sum(axis=-2)
        if block.shared_experts is not None:
            y = y + block.shared_experts(x)
        return y


class BailingMoeV3Adapter(_Grouped):
    """bailing_moe_v3: float32 router, sigmoid + selection-only ``expert_bias``, always group-limited (dropped groups
    at -inf), renormalised and scaled; shared expert."""

    model_types = ("bailing_moe_v3",)
    router_attr = "gate"

    def route(self, block, x, steer=None):
        gate = block.gate
        select = model_function(gate, "_group_expert_select")
        logits = x.astype(mx.float32) @ gate.weight.astype(mx.float32).T
        gates = steered(logits, steer)
        inds, scores = select(
            gates,
            steered_correction(gate.expert_bias, steer, lambda: mx.sigmoid(gates.astype(mx.float32))),
            gate.top_k,
            gate.n_group,
            gate.topk_group,
            gate.routed_scaling_factor,
        )
        return inds, scores, logits

    def combine(self, block, x, y, weights):
        y = (y * weights[..., None]).sum(axis=-2).astype(x.dtype)
        return y + block.shared_experts(x)


class BailingHybridAdapter(BailingMoeV3Adapter):
    """bailing_hybrid: bailing_moe_v3's routing written inline in the gate (sigmoid or softmax); a
    ``BailingMoeV3ForCausalLM`` config of this type loads (and routes) as bailing_moe_v3."""

    model_types = ("bailing_hybrid",)
    extra_expert_params = ("gate.expert_bias",)

    @property
    def router_attr(self) -> str:  # type: ignore[override]
        return "gate.gate_proj" if hasattr(self.block(self._moe_layers[0]).gate, "gate_proj") else "gate"

    def route(self, block, x, steer=None):
        gate = block.gate
        if not hasattr(gate, "gate_proj"):
            return super().route(block, x, steer)
        logits = gate.gate_proj(x)
        gates = steered(logits, steer)
        in_type = gates.dtype
        gates = gates.astype(mx.float32)
        if gate.score_function == "sigmoid":
            scores = mx.sigmoid(gates)
        else:
            scores = mx.softmax(gates, axis=-1)
        orig_scores = scores
        if gate.expert_bias is not None:
            scores = scores + gate.expert_bias
        scores = steered_selection(scores, steer)
        n_drop = gate.n_group - gate.topk_group
        if n_drop > 0:
            scores = mx.unflatten(scores, axis=-1, shape=(gate.n_group, -1))
            group_scores = mx.topk(scores, 2, axis=-1).sum(axis=-1, keepdims=True)
            group_idx = mx.argpartition(group_scores, kth=n_drop - 1, axis=-2)[..., :n_drop, :]
            scores = mx.put_along_axis(
                scores, mx.stop_gradient(group_idx), mx.array(-mx.inf, scores.dtype), axis=-2
            )
            scores = mx.flatten(scores, -2, -1)
        inds = mx.stop_gradient(topk_desc(scores, gate.top_k))
        scores = mx.take_along_axis(orig_scores, inds, axis=-1)
        if gate.top_k > 1 and gate.norm_topk_prob:
            scores = scores / (scores.sum(axis=-1, keepdims=True) + 1e-20)
        scores = scores * gate.routed_scaling_factor
        return inds, scores.astype(in_type), logits

    def combine(self, block, x, y, weights):
        if not hasattr(block.gate, "gate_proj"):
            return super().combine(block, x, y, weights)
        y = (y * weights[..., None]).sum(axis=-2)
        if block.shared_experts is not None:
            y = y + block.shared_experts(x)
        return y


class GraniteMoeAdapter(MoEAdapter):
    """granitemoe: top-k (ascending idiom) on raw logits of ``router.layer``, float32 softmax over the k."""

    model_types = ("granitemoe",)
    block_attr = "block_sparse_moe"
    router_attr = "router.layer"
    num_experts_key = "num_local_experts"

    def _top_k_logits(self, block, x, steer):
        logits = block.router.layer(x)
        gates = steered(logits, steer)
        inds = mx.stop_gradient(topk_tail(gates, block.router.top_k))
        return inds, mx.take_along_axis(gates, inds, axis=-1), logits

    def route(self, block, x, steer=None):
        inds, top, logits = self._top_k_logits(block, x, steer)
        return inds, mx.softmax(top.astype(mx.float32), axis=-1), logits

    def combine(self, block, x, y, weights):
        return (y * weights[..., None]).sum(axis=-2).astype(y.dtype)


class GraniteMoeHybridAdapter(GraniteMoeAdapter):
    """granitemoehybrid: precise softmax over the k; the shared MLP sits on the decoder layer, outside the block."""

    model_types = ("granitemoehybrid",)

    def route(self, block, x, steer=None):
        inds, top, logits = self._top_k_logits(block, x, steer)
        return inds, mx.softmax(top, precise=True, axis=-1), logits

    def combine(self, block, x, y, weights):
        return (y * weights[..., None]).sum(axis=-2)


class LagunaAdapter(MoEAdapter):
    """laguna: sigmoid + correction bias, renormalised; the routed scaling multiplies the sum, not the weights."""

    model_types = ("laguna",)
    router_attr = "gate.proj"
    extra_expert_params = ("gate.e_score_correction_bias",)

    def route(self, block, x, steer=None):
        gate = block.gate
        logits = gate.proj(x).astype(mx.float32)
        gates = steered(logits, steer)
        if gate.softcap > 0.0:
            gates = mx.tanh(gates / gate.softcap) * gate.softcap
        scores = mlx_lm_compat.member(gate, "_routing_scores")(gates)
        inds = mx.stop_gradient(topk_desc(steered_selection(scores + gate.e_score_correction_bias, steer), gate.top_k))
        weights = mx.take_along_axis(scores, inds, axis=-1)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        return inds, weights, logits

    def combine(self, block, x, y, weights):
        y = (y * weights[..., None]).sum(axis=-2).astype(x.dtype)
        return y * block.routed_scaling_factor + block.shared_expert(x)
