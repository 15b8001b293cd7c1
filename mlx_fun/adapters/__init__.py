"""Per-family adapters and the registry keyed by ``model_type``."""

from __future__ import annotations

from .. import mlx_lm_compat
from ..errors import UserError
from .bailing import (
    BailingHybridAdapter,
    BailingMoeAdapter,
    BailingMoeLinearAdapter,
    BailingMoeV3Adapter,
    GraniteMoeAdapter,
    GraniteMoeHybridAdapter,
    LagunaAdapter,
)
from .base import MoEAdapter
from .deepseek import DeepSeekAdapter
from .deepseek_like import (
    DeepSeekV1Adapter,
    DeepSeekV2Adapter,
    ExaoneMoeAdapter,
    HunyuanAdapter,
    KimiLinearAdapter,
    MiMoV2FlashAdapter,
    Mistral4Adapter,
)
from .deepseek_v4 import DeepSeekV41Adapter
from .gemma import Gemma4Adapter
from .inline import (
    AfmoeAdapter,
    Ernie45MoeAdapter,
    JambaAdapter,
    KlearAdapter,
    Lfm2MoeAdapter,
    MellumAdapter,
    PhiMoeAdapter,
)
from .latent import KimiK3Adapter, NemotronHAdapter
from .minimax import MiniMaxAdapter, MiniMaxM3Adapter
from .mixtral import GptOssAdapter, Llama4Adapter, MixtralAdapter, PhixtralAdapter
from .qwen import OlmoeAdapter, Qwen2MoeAdapter, Qwen3MoeAdapter, Qwen3NextAdapter
from .step import Step3p5Adapter

_ADAPTERS: tuple[type[MoEAdapter], ...] = (
    MiniMaxAdapter,
    DeepSeekAdapter,
    DeepSeekV1Adapter,
    DeepSeekV2Adapter,
    ExaoneMoeAdapter,
    MiMoV2FlashAdapter,
    Mistral4Adapter,
    KimiLinearAdapter,
    HunyuanAdapter,
    Qwen3MoeAdapter,
    Qwen3NextAdapter,
    Qwen2MoeAdapter,
    OlmoeAdapter,
    MixtralAdapter,
    GptOssAdapter,
    Gemma4Adapter,
    NemotronHAdapter,
    KimiK3Adapter,
    DeepSeekV41Adapter,
    PhixtralAdapter,
    Llama4Adapter,
    MiniMaxM3Adapter,
    Step3p5Adapter,
    Ernie45MoeAdapter,
    Lfm2MoeAdapter,
    PhiMoeAdapter,
    AfmoeAdapter,
    JambaAdapter,
    MellumAdapter,
    KlearAdapter,
    BailingMoeAdapter,
    BailingMoeLinearAdapter,
    BailingMoeV3Adapter,
    BailingHybridAdapter,
    GraniteMoeAdapter,
    GraniteMoeHybridAdapter,
    LagunaAdapter,
)

REGISTRY: dict[str, type[MoEAdapter]] = {mt: cls for cls in _ADAPTERS for mt in cls.model_types}

#: mlx-lm model types whose config loads another type's module (mlx-lm's ``MODEL_REMAPPING``): same adapter
ALIASES: dict[str, str] = {
    "joyai_llm_flash": "deepseek_v3", "gemma4_unified": "gemma4", "phi-msft": "phixtral",
    "deepseek_v41_text": "deepseek_v41", "llava": "mistral3",
}
REGISTRY.update({alias: REGISTRY[target] for alias, target in ALIASES.items()})

#: MoE model types of the installed mlx-lm that no adapter serves, each with the reason (docs/guide/architectures.md, errors)
UNSUPPORTED: dict[str, str] = {
    "longcat_flash": "the router also picks zero-computation identity experts beyond the routed ones, which saliency "
    "and pruning have no slot for",
    "longcat_flash_ngram": "longcat_flash's MoE (see there)",
    "muse_spark": "routing and the expert combine run as custom Metal kernels (mlx_lm.kernels), which no adapter can "
    "replay with MLX operations, and which do not run off Apple GPUs",
    "prism_hadamard_qwen35": "pre-packed 2-bit Hadamard-rotated weights laid out by a module manifest, which prune and "
    "merge would have to rewrite",
}


def supported_model_types() -> list[str]:
    return sorted(REGISTRY)


def adapter_class(config: dict) -> type[MoEAdapter]:
    """The adapter class of ``config['model_type']`` (config facts without loading weights); ``UserError`` if none,
    or if the installed mlx-lm lacks a private name its routing uses (:mod:`mlx_fun.mlx_lm_compat`)."""
    cls = REGISTRY.get(config.get("model_type"))
    if cls is None and config.get("model_type") in UNSUPPORTED:
        mt = config["model_type"]
        raise UserError(f"model_type '{mt}' is not supported: {UNSUPPORTED[mt]}.")
    if cls is None:
        raise UserError(
            f"model_type '{config.get('model_type')}' is not supported; supported types: "
            f"{', '.join(supported_model_types())}."
        )
    mt = config["model_type"]
    mlx_lm_compat.require(mlx_lm_compat.routing_feature(ALIASES.get(mt, mt)))
    return cls


def get_adapter(model, config: dict) -> MoEAdapter:
    """The adapter for ``config['model_type']``; an unsupported type is a ``UserError`` listing the supported."""
    return adapter_class(config)(model, config)


__all__ = ["ALIASES", "MoEAdapter", "REGISTRY", "UNSUPPORTED", "adapter_class", "get_adapter", "supported_model_types"]
