"""The adapter protocol: everything the toolkit needs to know about one MoE family.

Routing is written once per family, here in ``mlx_fun/adapters``; every feature (collect, steer, prune,
merge, serve) goes through ``route`` and ``combine`` and never re-implements them. With no bias, ``route``
reproduces the block's own expert indices bit for bit: it runs the same MLX operations in the same order as
the block's ``__call__`` in mlx-lm.
"""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from .. import mlx_lm_compat
from ..errors import UserError


class MoEAdapter:
    """Base adapter. Subclasses set the class attributes and implement ``route`` and ``combine``."""

    #: model_type values this adapter serves (the registry key)
    model_types: tuple[str, ...] = ()
    #: attribute of a decoder layer that holds the MoE block ("": the decoder layer itself)
    block_attr: str = "mlp"
    #: attribute of the MoE block that holds the experts (an mlx-lm ``SwitchGLU``)
    experts_attr: str = "switch_mlp"
    #: attribute of the MoE block that holds the router
    router_attr: str = "gate"
    #: config keys of the routed-expert count and of top-k
    num_experts_key: str = "num_experts"
    top_k_key: str = "num_experts_per_tok"
    #: block parameters (besides experts and router) whose leading axis is the expert axis
    extra_expert_params: tuple[str, ...] = ()
    #: how the experts compute (the oracle of ``tests/oracles.py`` that checks them): one of ``EXPERT_TYPES``
    expert_type: str = "swiglu"
    #: the router and the experts are separate calls of the decoder layer (gemma4): the hook wraps both, and
    #: ``block`` is the decoder layer itself
    split_router: bool = False
    #: the routing weight scales the experts' *input* (llama4: ``experts(x * w)``), not their outputs
    weights_at_input: bool = False
    #: why the family's decoder layers cannot be replayed one at a time (merge refuses it), or None
    layerwise_reason: str | None = None

    def __init__(self, model, config: dict):
        self.model = model
        self.config = config
        self._moe_layers = [
            i for i, layer in enumerate(self.decoder_layers()) if self._is_moe(self._block_of(layer))
        ]
        if not self._moe_layers:
            raise UserError(
                f"this {self.model_type} model has no MoE layers (its config has no routed experts); mlx-fun works on "
                "mixture-of-experts models."
            )

    # ----------------------------------------------------------------- config facts (no model needed)
    @classmethod
    def config_num_experts(cls, config: dict) -> int:
        """The routed-expert count that config.json records for this family."""
        return int(config.get("text_config", config)[cls.num_experts_key])

    @classmethod
    def config_top_k(cls, config: dict) -> int:
        return int(config.get("text_config", config)[cls.top_k_key])

    @classmethod
    def check_config(cls, config: dict, *, where) -> None:
        """A one-line ``UserError`` for expert facts of config.json (``where``: the file) that mlx-lm would only
        trip over mid-forward: the routed-expert count must be a whole number >= 0, top-k one >= 1 (hunyuan: or a
        list of equal ones) and at most the expert count. Absent keys are mlx-lm's to default or to ask for."""
        from ..datasets.samples import MAX_COUNT, json_type_name, json_whole

        cfg, fix = config.get("text_config", config), "fix it or re-download the model."
        experts, top_k = cfg.get(cls.num_experts_key), cfg.get(cls.top_k_key)
        if cls.num_experts_key in cfg and not (json_whole(experts, 0) and experts <= MAX_COUNT):
            raise UserError(f"{where}: {cls.num_experts_key} (the routed-expert count) must be a whole number from 0 "
                            f"(a dense checkpoint) to {MAX_COUNT:,}, got {json_type_name(experts)} "
                            f"{json.dumps(experts)[:40]}; {fix}")
        if cls.top_k_key not in cfg:
            return
        if not all(json_whole(k, 1) for k in (top_k if isinstance(top_k, list) and top_k else [top_k])):
            raise UserError(f"{where}: {cls.top_k_key} (experts per token) must be a whole number of at least 1, "
                            f"got {json_type_name(top_k)} {json.dumps(top_k)}; {fix}")
        try:
            k = cls.config_top_k(config)
        except ValueError as e:
            raise UserError(f"{where}: {e}; {fix}") from None
        if experts and k > experts:
            raise UserError(f"{where}: {cls.top_k_key} = {k} is more than the {experts} routed experts "
                            f"({cls.num_experts_key}); top-k must be at most the expert count: {fix}")

    # ----------------------------------------------------------------- structure
    @property
    def model_type(self) -> str:
        return self.config.get("model_type", self.model_types[0])

    @property
    def text_config(self) -> dict:
        """The dict that holds the text model's settings (``text_config`` for multimodal wrappers)."""
        return self.config.get("text_config", self.config)

    def config_keys(self) -> list[tuple[str, ...]]:
        """Paths in config.json of the routed-expert count (rewrites update each one that exists)."""
        if "text_config" in self.config:
            return [("text_config", self.num_experts_key)]
        return [(self.num_experts_key,)]

    def decoder_layers(self) -> list:
        return list(self.model.layers)

    def _is_moe(self, block) -> bool:
        return block is not None and hasattr(block, self.experts_attr)

    def moe_layers(self) -> list[int]:
        """Decoder-layer indices that hold an MoE block, in order."""
        return list(self._moe_layers)

    def _block_of(self, layer):
        return getattr(layer, self.block_attr, None) if self.block_attr else layer

    def block(self, layer: int):
        return self._block_of(self.decoder_layers()[layer])

    def blocks(self) -> list:
        return [self.block(i) for i in self._moe_layers]

    def experts(self, block):
        """The block's ``SwitchGLU``: called as ``experts(x, inds)`` it returns (..., k, D) unweighted outputs."""
        return getattr(block, self.experts_attr)

    def router(self, block):
        """The router module (``router_attr`` may be a dotted path: ``gate.gate_proj``, ``router.layer``)."""
        for part in self.router_attr.split("."):
            block = getattr(block, part)
        return block

    def expert_params(self, block) -> dict:
        """Constants of the experts' activation for ``block`` (alpha / limit of clamped SwiGLUs), from config.json."""
        return {}

    def layerwise_blocker(self) -> str | None:
        """Why this model's decoder layers cannot be run one at a time (``layerwise_reason``, or a config option
        of the family), or None: what a layer-by-layer job (merge, a streamed collect) refuses early."""
        return self.config_layerwise_blocker(self.config)

    @classmethod
    def config_layerwise_blocker(cls, config: dict) -> str | None:
        """:meth:`layerwise_blocker` from the config alone (before a model is loaded: the automatic choice of
        ``--stream-layers``)."""
        return cls.layerwise_reason

    def layer_passthrough(self, x: mx.array, *args, **kwargs):
        """What a decoder layer that does nothing returns when called as ``layer(x, *args, **kwargs)``
        (``mlx_fun.model.layerwise`` stand-ins): ``x``, for layers that return their hidden state alone."""
        if self.layerwise_reason:
            raise UserError(
                f"merge rewrites the model layer by layer, which {self.model_type} does not allow: "
                f"{self.layerwise_reason}; use prune."
            )
        return x

    def expert_caller(self, block):
        """``split_router`` families: the module the decoder layer calls as ``m(x, inds, weights)``."""
        raise NotImplementedError

    @property
    def num_experts(self) -> int:
        return expert_count(self.experts(self.block(self._moe_layers[0])))

    @property
    def hidden_size(self) -> int:
        """Width of the residual stream (what the MoE block is called on)."""
        return self.config_hidden_size(self.config)

    #: the text config's key of the residual stream's width
    hidden_size_key: str = "hidden_size"

    @classmethod
    def config_hidden_size(cls, config: dict) -> int:
        """:attr:`hidden_size` from the config alone (before a model is loaded: the automatic choice of
        ``--stream-layers`` sizes the hidden states it would carry)."""
        return int(config.get("text_config", config)[cls.hidden_size_key])

    @property
    def top_k(self) -> int:
        return int(self.text_config[self.top_k_key])

    #: group-limited routers: config keys of the group count and of the groups kept (None: never group-limited)
    group_keys: tuple[str, str] | None = None
    #: group-limited routers: experts a group is scored by (the sum of its top two; deepseek_v2: its best one)
    group_min_experts: int = 2

    @property
    def groups(self) -> tuple[int, int] | None:
        """(n_group, topk_group) when the router is group-limited, else None."""
        if self.group_keys is None:
            return None
        n_group = int(self.text_config.get(self.group_keys[0]) or 1)
        if n_group > 1:
            return n_group, int(self.text_config.get(self.group_keys[1]) or n_group)
        return None

    def prepare(self, block, x: mx.array) -> mx.array:
        """The input as the block hands it to its router and experts (olmoe flattens tokens)."""
        return x

    def expert_input(self, block, x: mx.array, inds: mx.array, weights: mx.array) -> mx.array:
        """What the experts are called on, from the prepared input ``x``: ``x`` itself, or its latent projection
        (nemotron_h), or ``x`` scaled by the routing weight (llama4)."""
        return x

    # ----------------------------------------------------------------- routing
    def route(self, block, x: mx.array, steer: "RouteSteer | None" = None):  # noqa: F821
        """Return ``(inds, weights, logits)`` exactly as the block computes them.

        ``steer`` (:class:`~mlx_fun.adapters.steer.RouteSteer`) is applied to the router logits before the family's
        activation and, where the family ranks by a selection-only score, to that score too; ``logits`` returned are the
        raw, unbiased router logits.
        """
        raise NotImplementedError

    def mixing_weights(self, block, x: mx.array, weights: mx.array) -> mx.array:
        """Each chosen expert's weight in the block output (what taps record): ``weights`` themselves, unless the
        block scales the routed sum per token (Klear's coefficient)."""
        return weights

    def combine(self, block, x: mx.array, y: mx.array, weights: mx.array) -> mx.array:
        """Weighted sum of expert outputs ``y`` (..., k, D) plus shared experts, as the block does it."""
        raise NotImplementedError

    # ----------------------------------------------------------------- weights
    def expert_tensors(self, block) -> list[str]:
        """Parameter paths (relative to the block) whose leading axis is the routed-expert axis.

        Router rows (weight/scales/biases/bias), correction biases and every projection tensor of the experts
        (weight/scales/biases/bias); never the shared experts.
        """
        E = expert_count(self.experts(block))
        heads = (self.experts_attr + ".", self.router_attr + ".")
        return [
            name
            for name, value in tree_flatten(block.parameters())
            if (name.startswith(heads) or name in self.extra_expert_params) and value.ndim >= 1 and value.shape[0] == E
        ]

    def describe(self) -> dict[str, Any]:
        return {
            "model_type": self.model_type,
            "adapter": type(self).__name__,
            "moe_layers": self.moe_layers(),
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "groups": self.groups,
        }


def model_function(module, name: str):
    """The function ``name`` of the mlx-lm model file that defines ``module``'s class — its own compiled selection
    function, say — walking the MRO, since a hooked module's class is a subclass defined in ``mlx_fun``. Every
    such name is listed in :data:`mlx_fun.mlx_lm_compat.TABLE`; one that this mlx-lm lacks is a one-line
    ``UserError`` naming it and the tested mlx-lm range."""
    return mlx_lm_compat.model_function(module, name)


#: expert computations with a plain-MLX oracle in ``tests/oracles.py``
EXPERT_TYPES = {
    "swiglu": "GEMM3_SWIGLU: down(silu(gate x) * up x)",
    "swiglu_oai": "GEMM2_BIAS_SWIGLU_CLAMP (gpt-oss, minimax_m3_vl): (clip(up) + 1) * swish_alpha(min(gate, limit))",
    "swiglu_preclamp": "down(silu(min(gate x, limit)) * clip(up x, -limit, limit)) in float32 (deepseek_v41)",
    "swiglu_clamped": "down(min(silu(gate x), limit) * clip(up x, -limit, limit)) (step3p5; limit 0: plain SwiGLU)",
    "geglu": "down(gelu_approx(gate x) * up x) (gemma4)",
    "relu2_mlp": "fc2(relu(fc1 x)^2) (nemotron_h)",
    "situ": "down(beta tanh(g / beta) sigmoid(g) * [linear_beta tanh(u / linear_beta) | u]) (kimi_k3)",
    "gelu_mlp": "fc2(gelu_tanh(fc1 x + b1)) + b2 (phixtral)",
}


def expert_projections(experts) -> tuple[tuple[str, ...], str]:
    """``(input projections, output projection)`` of an mlx-lm expert module: a ``SwitchGLU`` has
    ``gate_proj``/``up_proj`` → ``down_proj``, a ``SwitchMLP`` ``fc1`` → ``fc2``."""
    if hasattr(experts, "fc1"):
        return ("fc1",), "fc2"
    return ("gate_proj", "up_proj"), "down_proj"


def expert_count(experts) -> int:
    """Routed experts of a ``SwitchGLU`` / ``SwitchMLP`` (read from its weights, so it follows slicing)."""
    return int(getattr(experts, expert_projections(experts)[1]).num_experts)


def intermediate(experts, pre: dict[str, mx.array]) -> mx.array:
    """The experts' hidden activation from the input projections' outputs ``pre`` (keyed by projection name),
    through the module's own activation function."""
    if "fc1" in pre:
        return experts.activation(pre["fc1"])
    return experts.activation(pre["up_proj"], pre["gate_proj"])


def topk_desc(scores: mx.array, k: int) -> mx.array:
    """``argpartition(-scores, kth=k-1)[..., :k]``: the idiom of mixtral, qwen2_moe, olmoe, minimax."""
    return mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]


def topk_tail(scores: mx.array, k: int) -> mx.array:
    """``argpartition(scores, kth=-k)[..., -k:]``: the idiom of qwen3_moe, qwen3_next and gpt_oss."""
    return mx.argpartition(scores, kth=-k, axis=-1)[..., -k:]
