"""Experts in a latent space: nemotron_h and kimi_k3 project the block input down before the experts and the
weighted sum back up after them (``expert_input`` / ``combine``); ``y`` handed to taps is the latent output.

nemotron_h: DeepSeek-style sigmoid router, ReLU² ``SwitchMLP`` experts, optionally in a latent space.

The MoE mixer routes on its input ``x`` with a ``MoEGate`` (sigmoid, selection-only correction bias,
group-limited top-k, optional renormalisation, routed scaling: the same compiled ``group_expert_select`` as
DeepSeek-V3, called from the model's own module). With ``moe_latent_size`` set (Nemotron-3 Super), the experts
run on ``fc1_latent_proj(x)`` and their weighted sum goes back through ``fc2_latent_proj``; the shared expert
always sees ``x``. ``y`` handed to taps is the experts' latent output.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import UserError
from .deepseek import DeepSeekAdapter
from .deepseek_like import KimiLinearAdapter


class NemotronHAdapter(DeepSeekAdapter):
    """nemotron_h: DeepSeek-V3 routing over ReLU² ``SwitchMLP`` experts, in a latent space when ``moe_latent_size`` is
    set; shared expert on the block input."""

    model_types = ("nemotron_h",)
    block_attr = "mixer"
    expert_type = "relu2_mlp"

    def _is_moe(self, block) -> bool:
        return block is not None and hasattr(block, "switch_mlp")

    def expert_input(self, block, x, inds, weights):
        return block.fc1_latent_proj(x) if block.moe_latent_size is not None else x

    def combine(self, block, x, y, weights):
        y = (y * weights[..., None]).sum(axis=-2).astype(y.dtype)
        if block.moe_latent_size is not None:
            y = block.fc2_latent_proj(y)
        if block.config.n_shared_experts is not None:
            y = y + block.shared_experts(x)
        return y


class KimiK3Adapter(KimiLinearAdapter):
    """kimi_k3: kimi_linear's sigmoid router (its own ``_group_expert_select``, no score-function argument) over
    SiTU experts, in a latent space when ``routed_expert_hidden_size`` is set (optionally RMS-normalised there)."""

    model_types = ("kimi_k3",)
    expert_type = "situ"

    def expert_params(self, block) -> dict:
        return {"beta": float(self.text_config.get("activation_situ_beta") or 1.0),
                "linear_beta": self.text_config.get("activation_situ_linear_beta")}

    def _selection_args(self, block) -> tuple:
        return super()._selection_args(block)[:-1]  # kimi_k3's selection has no score-function argument

    def _scores(self, block, gates):
        return mx.sigmoid(gates.astype(mx.float32))  # kimi_k3's selection: float32 sigmoid only

    def expert_input(self, block, x, inds, weights):
        return block.routed_expert_down_proj(x) if block.latent_size is not None else x

    def layer_passthrough(self, x, *args, **kwargs):
        """Layers return ``(h, blocks)``; without attention residuals (``attn_res_block_size``) ``blocks`` passes
        through untouched. With them, later layers mix earlier layers' outputs, which a layer-by-layer replay
        does not carry."""
        if self.text_config.get("attn_res_block_size") is not None:
            raise UserError(
                "layer-by-layer rewrites (merge) of kimi_k3 models with attention residuals (attn_res_block_size) "
                "are not supported; use prune."
            )
        return x, kwargs.get("blocks")

    def combine(self, block, x, y, weights):
        y = (y * weights[..., None]).sum(axis=-2)
        if block.routed_expert_norm is not None:
            y = block.routed_expert_norm(y)
        if block.latent_size is not None:
            y = block.routed_expert_up_proj(y)
        if block.shared_experts is not None:
            y = y + block.shared_experts(x)
        return y
