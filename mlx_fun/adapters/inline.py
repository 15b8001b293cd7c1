"""Families whose block routes inline: ernie4_5_moe, lfm2_moe, phimoe, afmoe, jamba, mellum, Klear.

Each ``route`` is the block's own ``__call__`` up to the expert call, with the logit bias added to the raw router
logits; where the model module defines a selection function (phimoe's ``sparsemixer``) the adapter calls that
very function, looked up in the module of the block's original class (a hooked block's class is a subclass
defined elsewhere).

Klear mixes the routed sum and the shared expert with a per-token softmax coefficient
(``sum(w * y) * c0 + shared * c1``): ``route`` returns the block's own ``w`` (so ``combine`` is bit-exact) and
``mixing_weights`` the experts' real weights in the output, ``c0 * w``, which is what taps record.
"""

from __future__ import annotations

import mlx.core as mx

from .base import MoEAdapter, model_function, topk_desc, topk_tail
from .steer import selection_order, steered, steered_selection
from .mixtral import MixtralAdapter


class Ernie45MoeAdapter(MoEAdapter):
    """ernie4_5_moe: the block's gate_act (softmax or sigmoid) in float32, descending top-k, renormalised with a
    1e-12 floor; plus an ungated shared expert."""

    model_types = ("ernie4_5_moe",)
    num_experts_key = "moe_num_experts"
    top_k_key = "moe_k"

    def route(self, block, x, steer=None):
        logits = block.gate(x)
        steered_logits = steered(logits, steer)
        gates = block.gate_act(steered_logits.astype(mx.float32))
        inds = mx.stop_gradient(topk_desc(selection_order(gates, steered_logits, steer), block.k))
        scores = mx.take_along_axis(gates, inds, axis=-1)
        scores = scores / mx.maximum(scores.sum(axis=-1, keepdims=True), 1e-12)
        return inds, scores, logits

    def combine(self, block, x, y, weights):
        y = (y * weights[..., None]).sum(axis=-2).astype(y.dtype)
        if block.shared_experts is not None:
            y = y + block.shared_experts(x)
        return y


class Lfm2MoeAdapter(MoEAdapter):
    """lfm2_moe: sigmoid scores; the block's float32 ``expert_bias`` only picks the top-k (ascending idiom); weights
    renormalised (+1e-6) and scaled by routed_scaling_factor."""

    model_types = ("lfm2_moe",)
    block_attr = "feed_forward"
    extra_expert_params = ("expert_bias",)

    def route(self, block, x, steer=None):
        logits = block.gate(x)
        routing_weights = mx.sigmoid(steered(logits, steer))
        k = block.top_k
        if block.use_expert_bias:
            inds = topk_tail(steered_selection(routing_weights.astype(mx.float32) + block.expert_bias, steer), k)
        else:
            inds = topk_tail(routing_weights, k)
        inds = mx.stop_gradient(inds)
        scores = mx.take_along_axis(routing_weights, inds, axis=-1)
        if block.norm_topk_prob:
            scores = scores / (mx.sum(scores, axis=-1, keepdims=True) + 1e-6)
        scores = scores * block.routed_scaling_factor
        return inds, scores.astype(x.dtype), logits

    def combine(self, block, x, y, weights):
        return (y * weights[..., None]).sum(axis=-2)


class PhiMoeAdapter(MoEAdapter):
    """phimoe: sparsemixer (k rounds of argmax, each weighted by a softmax over its jitter band), run as the model
    module's own ``sparsemixer`` on the biased gates."""

    model_types = ("phimoe",)
    block_attr = "block_sparse_moe"
    num_experts_key = "num_local_experts"

    def route(self, block, x, steer=None):
        logits = block.gate(x)
        sparsemixer = model_function(block, "sparsemixer")
        inds, scores = sparsemixer(steered(logits, steer), top_k=block.top_k, jitter_eps=block.jitter_eps)
        return inds, scores, logits

    def combine(self, block, x, y, weights):
        return (y * weights[..., None]).sum(axis=-2)


class AfmoeAdapter(MoEAdapter):
    """afmoe: sigmoid (or softmax) scores in float32, the block's ``expert_bias`` only for selection, optional
    group-limited top-k (top-2 sum per group), renormalised and scaled by route_scale; plus a shared expert. The
    router is ``router.gate``."""

    model_types = ("afmoe",)
    experts_attr = "experts"
    router_attr = "router.gate"
    extra_expert_params = ("expert_bias",)
    group_keys = ("n_group", "topk_group")

    def route(self, block, x, steer=None):
        logits = block.router(x)
        gates = steered(logits, steer)
        if block.score_func == "sigmoid":
            scores = mx.sigmoid(gates.astype(mx.float32))
        else:
            scores = mx.softmax(gates.astype(mx.float32), axis=-1)
        selection_scores = steered_selection(scores + block.expert_bias, steer)
        if block.n_group > 1:
            selection_scores = mx.unflatten(selection_scores, axis=-1, shape=(block.n_group, -1))
            group_scores = mx.topk(selection_scores, 2, axis=-1).sum(axis=-1, keepdims=True)
            k = block.n_group - block.topk_group
            group_idx = mx.argpartition(group_scores, kth=k - 1, axis=-2)[..., :k, :]
            selection_scores = mx.put_along_axis(
                selection_scores, mx.stop_gradient(group_idx), mx.array(0.0), axis=-2
            )
            selection_scores = mx.flatten(selection_scores, -2, -1)
        inds = mx.stop_gradient(topk_desc(selection_scores, block.num_experts_per_tok))
        selected = mx.take_along_axis(scores, inds, axis=-1)
        if block.route_norm and block.num_experts_per_tok > 1:
            selected = selected / selected.sum(axis=-1, keepdims=True)
        return inds, selected * block.route_scale, logits

    def combine(self, block, x, y, weights):
        y = (y * weights[..., None]).sum(axis=-2).astype(y.dtype)
        if block.args.num_shared_experts > 0:
            y = y + block.shared_experts(x)
        return y


class JambaAdapter(MixtralAdapter):
    """jamba: mixtral's routing (descending top-k on raw logits, softmax over the k) in ``feed_forward.router``."""

    model_types = ("jamba",)
    block_attr = "feed_forward"
    router_attr = "router"
    num_experts_key = "num_experts"


class MellumAdapter(MoEAdapter):
    """mellum: qwen3_moe's routing (precise softmax, ascending top-k, optional renormalisation), no shared expert."""

    model_types = ("mellum",)

    def route(self, block, x, steer=None):
        logits = block.gate(x)
        steered_logits = steered(logits, steer)
        gates = mx.softmax(steered_logits, axis=-1, precise=True)
        inds = mx.stop_gradient(topk_tail(selection_order(gates, steered_logits, steer), block.top_k))
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if block.norm_topk_prob:
            scores = scores / mx.sum(scores, axis=-1, keepdims=True)
        return inds, scores, logits

    def combine(self, block, x, y, weights):
        return (y * weights[..., None]).sum(axis=-2)


class KlearAdapter(MoEAdapter):
    """Klear: float32 sigmoid scores, the block's ``expert_bias`` only for selection (descending idiom), optional
    renormalisation; the routed sum and the shared expert are mixed by a per-token softmax over ``coefficient``."""

    model_types = ("Klear",)
    experts_attr = "experts"
    extra_expert_params = ("expert_bias",)

    def route(self, block, x, steer=None):
        logits = block.gate(x)
        routing_weights = mx.sigmoid(steered(logits, steer).astype(mx.float32))
        # the block adds expert_bias.reshape((1, 1, -1)): the same sums, but it only accepts (B, L, D) inputs
        biased_weights = steered_selection(routing_weights + block.expert_bias, steer)
        inds = mx.stop_gradient(topk_desc(biased_weights, block.top_k))
        scores = mx.take_along_axis(routing_weights, inds, axis=-1)
        if block.norm_topk_prob:
            scores = scores / mx.sum(scores, axis=-1, keepdims=True)
        return inds, scores.astype(x.dtype), logits

    def mixing_weights(self, block, x, weights):
        return weights * mx.softmax(block.coefficient(x), axis=-1, precise=True)[..., :1]

    def combine(self, block, x, y, weights):
        y_experts = (y * weights[..., None]).sum(axis=-2)
        coef = mx.softmax(block.coefficient(x), axis=-1, precise=True)
        shared = block.shared_experts(x)
        return y_experts * coef[..., :1] + shared * coef[..., 1:]
