"""nemotron_h: DeepSeek-style sigmoid router, ReLU² ``SwitchMLP`` experts, optionally in a latent space.

The MoE mixer routes on its input ``x`` with a ``MoEGate`` (sigmoid, selection-only correction bias,
group-limited top-k, optional renormalisation, routed scaling: the same compiled ``group_expert_select`` as
DeepSeek-V3, called from the model's own module). With ``moe_latent_size`` set (Nemotron-3 Super), the experts
run on ``fc1_latent_proj(x)`` and their weighted sum goes back through ``fc2_latent_proj``; the shared expert
always sees ``x``. ``y`` handed to taps is the experts' latent output.
"""

from __future__ import annotations

from .deepseek import DeepSeekAdapter


class NemotronHAdapter(DeepSeekAdapter):
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
