"""gemma4 / gemma4_text: the decoder layer routes and runs the experts itself (``split_router``).

Each MoE decoder layer (``enable_moe``) runs a dense MLP on ``pre_feedforward_layernorm(h)`` and, beside it,
``router(h)`` → ``experts(pre_feedforward_layernorm_2(h), inds, weights)``: the router sees the residual
stream, the experts a differently normalised copy. There is no MoE block to swap, so the hook swaps the
``Router`` and the ``Experts`` modules (see :mod:`mlx_fun.model.moe_hook`) and ``block`` is the decoder layer.

Router: ``rms_norm(x, scale · D^-½)`` → ``proj`` → top-k (``argpartition(s, kth=-k)[..., -k:]``) on the raw
scores → softmax over the k → × ``per_expert_scale[inds]``. Experts: ``SwitchGLU`` with GeGLU
(``gelu_approx(gate) · up``). Router rows (``proj`` weight / scales / biases) and ``per_expert_scale`` are on
the expert axis and are sliced with the experts.
"""

from __future__ import annotations

import mlx.core as mx

from .. import mlx_lm_compat
from ..errors import UserError
from .base import MoEAdapter, topk_tail
from .steer import steered


class Gemma4Adapter(MoEAdapter):
    """gemma4: the decoder layer calls router and experts itself; RMS-normed router, top-k on raw scores, softmax over
    the k times ``per_expert_scale``; GeGLU experts beside a dense MLP."""

    model_types = ("gemma4_text", "gemma4")
    block_attr = ""  # the decoder layer is the block
    experts_attr = "experts"
    router_attr = "router"
    top_k_key = "top_k_experts"
    expert_type = "geglu"
    split_router = True

    def _is_moe(self, block) -> bool:
        return block is not None and bool(getattr(block, "enable_moe", False))

    def layer_passthrough(self, x, *args, **kwargs):
        """A gemma4 decoder layer returns ``(h, shared_kv, offset)``; a layer with no KV sharing hands the next
        ones nothing they read, so ``(x, None, None)`` is exact. KV-shared layers read the real K/V of earlier
        layers, which a layer-by-layer replay does not have."""
        if int(self.text_config.get("num_kv_shared_layers") or 0):
            raise UserError(
                "layer-by-layer rewrites (merge) of gemma4 models with KV-shared layers (num_kv_shared_layers > 0) "
                "are not supported; use prune."
            )
        return x, None, None

    def experts(self, block):
        return block.experts.switch_glu

    def expert_caller(self, block):
        return block.experts

    def route(self, block, x, steer=None):
        router = block.router
        k = router.config.top_k_experts
        x = mx.fast.rms_norm(x, router.scale * mlx_lm_compat.member(router, "_root_size"), router.eps)
        logits = router.proj(x)
        scores = steered(logits, steer)
        inds = mx.stop_gradient(topk_tail(scores, k))
        weights = mx.take_along_axis(scores, inds, axis=-1)
        weights = mx.softmax(weights, axis=-1)
        weights = weights * router.per_expert_scale[inds]
        return inds, weights, logits

    def combine(self, block, x, y, weights):
        return (mx.expand_dims(weights, -1) * y).sum(-2)
