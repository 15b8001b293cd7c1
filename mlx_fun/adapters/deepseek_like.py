"""DeepSeek-like routers that the MoEGate adapter of ``deepseek.py`` does not cover: deepseek (v1), deepseek_v2,
exaone_moe, mimo_v2_flash, mistral4 and kimi_linear; and hunyuan.

Where the model file has a module-level (compiled) selection function, ``route`` calls that very function with
the biased logits, looked up in the module that defines the block's class, so it runs what the block runs.
The others (deepseek, deepseek_v2, hunyuan) select inline in their gate or block; ``route`` replays those
operations one by one.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import UserError
from .base import MoEAdapter, model_function, topk_desc
from .steer import selection_order, steered, steered_correction
from .deepseek import DeepSeekAdapter


class DeepSeekV1Adapter(MoEAdapter):
    """deepseek (v1): precise softmax over all experts, descending top-k, no renormalisation or scaling."""

    model_types = ("deepseek",)
    num_experts_key = "n_routed_experts"

    def route(self, block, x, steer=None):
        gate = block.gate
        logits = x @ gate.weight.T
        gates = steered(logits, steer)
        scores = mx.softmax(gates, axis=-1, precise=True)
        inds = mx.stop_gradient(topk_desc(selection_order(scores, gates, steer), gate.top_k))
        scores = mx.take_along_axis(scores, inds, axis=-1)
        return inds, scores, logits

    def combine(self, block, x, y, weights):
        y = (y * weights[..., None]).sum(axis=-2)
        if block.config.n_shared_experts is not None:
            y = y + block.shared_experts(x)
        return y


class DeepSeekV2Adapter(DeepSeekV1Adapter):
    """deepseek_v2: softmax scores; ``group_limited_greedy`` zeroes the groups outside the best topk_group by max
    score; weights times routed_scaling_factor, never renormalised."""

    group_min_experts = 1

    model_types = ("deepseek_v2",)

    @property
    def groups(self):
        cfg = self.text_config
        n_group = int(cfg.get("n_group") or 1)
        if cfg.get("topk_method") == "group_limited_greedy" and n_group > 1:
            return n_group, int(cfg.get("topk_group") or n_group)
        return None

    def route(self, block, x, steer=None):
        gate = block.gate
        logits = x @ gate.weight.T
        gates = steered(logits, steer)
        probs = mx.softmax(gates, axis=-1, precise=True)
        scores = selection_order(probs, gates, steer)
        if gate.topk_method == "group_limited_greedy":
            bsz, seq_len = x.shape[:2]
            scores = scores.reshape(bsz, seq_len, gate.n_group, -1)
            group_scores = scores.max(axis=-1, keepdims=True)
            k = gate.n_group - gate.topk_group
            group_idx = mx.argpartition(group_scores, kth=k - 1, axis=-2)[..., :k, :]
            group_idx = mx.stop_gradient(group_idx)
            fill = 0.0 if steer is None else -mx.inf  # steered: ranked by logits, where a dropped group is -inf
            scores = mx.put_along_axis(scores, group_idx, mx.array(fill, scores.dtype), axis=-2)
            scores = scores.reshape(bsz, seq_len, -1)
        k = gate.top_k
        inds = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
        inds = mx.stop_gradient(inds)
        scores = mx.take_along_axis(probs, inds, axis=-1)
        scores = scores * gate.routed_scaling_factor
        return inds, scores, logits


class ExaoneMoeAdapter(DeepSeekAdapter):
    """exaone_moe: the DeepSeek-V3 MoEGate (sigmoid, correction bias, n_group) with its own ``group_expert_select``
    (renormalises only when top_k > 1); MoE layers listed by ``is_moe_layer``."""

    model_types = ("exaone_moe",)
    num_experts_key = "num_experts"


class MiMoV2FlashAdapter(DeepSeekAdapter):
    """mimo_v2_flash: the DeepSeek-V3 MoEGate (sigmoid, correction bias, n_group) with its own
    ``group_expert_select``; MoE layers listed by ``moe_layer_freq``."""

    model_types = ("mimo_v2_flash",)


class Mistral4Adapter(MoEAdapter):
    """mistral4 (also as mistral3's text model): float32 softmax (not precise), n_group top-2-sum group limit, weights from the unmasked scores,
    optional renormalisation, routed_scaling_factor; router is a plain ``nn.Linear``, no correction bias."""

    model_types = ("mistral4", "mistral3")
    num_experts_key = "n_routed_experts"
    group_keys = ("n_group", "topk_group")


    def route(self, block, x, steer=None):
        args = block.args
        logits = block.gate(x)
        if steer is not None:
            return (*self._steered_select(block, steered(logits, steer)), logits)
        gates = logits
        inds, scores = model_function(block, "mistral4_expert_select")(
            gates,
            block.num_experts_per_tok,
            args.n_group,
            args.topk_group,
            args.routed_scaling_factor,
            args.norm_topk_prob,
        )
        return inds, scores, logits

    def _steered_select(self, block, gates):
        """``mistral4_expert_select`` on steered gates, ranked in log space: the same choice in exact arithmetic,
        but a +1e4 boost cannot saturate the softmax into ties (group score log(p1 + p2) = logaddexp of the top 2
        log-probabilities; dropped groups at -inf); weights from the softmax as the family computes them."""
        args = block.args
        logp = gates.astype(mx.float32)
        logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)
        order = logp
        if args.n_group > 1:
            grouped = mx.unflatten(logp, axis=-1, shape=(args.n_group, -1))
            top2 = mx.topk(grouped, 2, axis=-1)
            group_scores = mx.logaddexp(top2[..., :1], top2[..., 1:])
            k = args.n_group - args.topk_group
            group_idx = mx.argpartition(group_scores, kth=k - 1, axis=-2)[..., :k, :]
            grouped = mx.put_along_axis(grouped, mx.stop_gradient(group_idx), mx.array(-mx.inf), axis=-2)
            order = mx.flatten(grouped, -2, -1)
        inds = mx.stop_gradient(topk_desc(order, block.num_experts_per_tok))
        scores = mx.take_along_axis(mx.softmax(gates.astype(mx.float32), axis=-1), inds, axis=-1)
        if args.norm_topk_prob:
            scores = scores / (scores.sum(axis=-1, keepdims=True) + 1e-20)
        return inds, scores * args.routed_scaling_factor

    def combine(self, block, x, y, weights):
        y = (y * weights[..., None]).sum(axis=-2).astype(y.dtype)
        if block.args.n_shared_experts is not None:
            y = y + block.shared_experts(x)
        return y


class KimiLinearAdapter(MoEAdapter):
    """kimi_linear: sigmoid (or softmax) scores, selection-only correction bias held on the block,
    num_expert_group group limit, renormalised when top_k > 1, routed_scaling_factor."""

    model_types = ("kimi_linear",)
    top_k_key = "num_experts_per_token"
    group_keys = ("num_expert_group", "topk_group")
    extra_expert_params = ("e_score_correction_bias",)


    def _selection_args(self, block) -> tuple:
        """The arguments of the model file's ``_group_expert_select`` after the gates and the bias."""
        a = block.args
        return (a.num_experts_per_token, a.num_expert_group, a.topk_group, a.routed_scaling_factor,
                a.moe_renormalize, a.moe_router_activation_func)

    def _scores(self, block, gates):
        """The scores ``_group_expert_select`` adds the bias to (sigmoid in the gates' dtype, or precise softmax)."""
        if block.args.moe_router_activation_func == "softmax":
            return mx.softmax(gates, axis=-1, precise=True)
        return mx.sigmoid(gates)

    def route(self, block, x, steer=None):
        logits = block.gate(x)
        gates = steered(logits, steer)
        select = model_function(block, "_group_expert_select")
        bias = steered_correction(block.e_score_correction_bias, steer, lambda: self._scores(block, gates))
        inds, scores = select(gates, bias, *self._selection_args(block))
        return inds, scores, logits

    def combine(self, block, x, y, weights):
        y = (y * weights[..., None]).sum(axis=-2)
        if block.shared_experts is not None:
            y = y + block.shared_experts(x)
        return y


class HunyuanAdapter(MoEAdapter):
    """hunyuan: precise softmax, descending top-k, never renormalised; the router is ``gate.wg``, weights are cast
    to float32 before the sum; per-layer ``moe_topk`` lists must hold one value.

    Decoder layers return ``(h, shared_kv_states)``; with cross-layer attention (``use_cla``) later layers read earlier layers' K/V,
    which a layer-by-layer replay (merge) does not have, so merge refuses those models."""

    model_types = ("hunyuan",)
    router_attr = "gate.wg"
    top_k_key = "moe_topk"

    @classmethod
    def config_top_k(cls, config: dict) -> int:
        top_k = config.get("text_config", config)[cls.top_k_key]
        if isinstance(top_k, list):
            if len(set(top_k)) != 1:
                raise ValueError(f"hunyuan: per-layer moe_topk {top_k} differ; one top-k is supported")
            top_k = top_k[0]
        return int(top_k)

    @property
    def top_k(self) -> int:
        return self.config_top_k(self.config)

    @classmethod
    def config_layerwise_blocker(cls, config: dict) -> str | None:
        if config.get("text_config", config).get("use_cla"):
            return "its cross-layer attention (use_cla) reads earlier layers' K/V"
        return None

    def layer_passthrough(self, x, *args, **kwargs):
        if self.text_config.get("use_cla"):
            raise UserError(
                "layer-by-layer rewrites (merge) of hunyuan models with cross-layer attention (use_cla) are not "
                "supported; use prune."
            )
        return x, None

    def route(self, block, x, steer=None):
        logits = block.gate(x)
        gates = steered(logits, steer)
        probs = mx.softmax(gates, axis=-1, precise=True)
        inds = mx.stop_gradient(topk_desc(selection_order(probs, gates, steer), block.top_k))
        scores = mx.take_along_axis(probs, inds, axis=-1)
        return inds, scores, logits

    def combine(self, block, x, y, weights):
        y = (y * weights[..., None].astype(mx.float32)).sum(axis=-2).astype(y.dtype)
        if block.use_shared_mlp:
            y = y + block.shared_mlp(x)
        return y
