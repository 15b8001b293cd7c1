"""MoE-aware mixed precision: which (bits, group size, mode) each module of a float MoE model gets.

Three classes of modules, told apart by the adapter (routing is the adapter's, never guessed from names):

- ``router``: each MoE block's router (``adapter.router``) — kept in float (``router_bits=16``) or 8-bit affine:
  it picks the experts, and its error moves tokens to other experts;
- ``experts``: the routed experts (``adapter.experts``: one stacked ``SwitchLinear`` per projection and layer);
- ``dense``: everything else that mlx-lm quantizes — attention, shared experts, dense MLPs, embeddings, the head:
  modules every token goes through.

Granularity (``--saliency``): mlx-lm's loader rebuilds a quantized model from one setting per *module path*
(``config["quantization"][path]``), and a layer's routed experts are one module (the expert axis is the leading
axis of one stacked tensor, quantized with one bits / group size / mode). So plain ``mlx_lm.load`` allows
different bits per layer's expert projections, not per expert: giving the coldest experts fewer bits would mean
splitting the stacked tensor into two modules, which mlx-lm's model classes do not build. The saliency file
therefore picks the coldest *MoE layers* (smallest sum of the metric over their experts) for ``cold`` bits.

Everything goes through mlx-lm's ``quantize_model`` with a predicate (and the family's own ``quant_predicate``
first: a module it refuses stays float). Quantization is lazy: the writer evaluates one tensor at a time.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

import click
import numpy as np

from ..core.options import Group, option
from ..errors import UserError, param

#: mode → (default group size, bits it forces or None, group sizes it allows)
MODES = {"affine": (64, None, (32, 64, 128)), "mxfp4": (32, 4, (32,)), "nvfp4": (16, 4, (16,)),
         "mxfp8": (32, 8, (32,))}
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
#: the bits of an affine setting left out (``None``)
DEFAULT_BITS = 4


@dataclass(frozen=True)
class Setting:
    bits: int
    group_size: int
    mode: str

    def params(self) -> dict:
        return {"bits": self.bits, "group_size": self.group_size, "mode": self.mode}

    def __str__(self) -> str:
        return f"{self.bits}-bit {self.mode} g{self.group_size}" if self.mode == "affine" else (
            f"{self.mode} g{self.group_size}")


def setting(name: str, bits: int | None, group_size: int | None, mode: str, *, group_param: str | None = None
            ) -> Setting:
    """A checked setting; ``name`` is the parameter prefix (``expert`` → ``expert_bits`` / ``expert_mode`` ...),
    ``group_param`` the parameter the group size came from (default ``<name>_group_size``). Only ``None`` means
    the mode's default group size: 0 is refused like any other size the mode does not allow; ``None`` bits: the
    mode's own (mxfp4 / nvfp4 4, mxfp8 8), affine :data:`DEFAULT_BITS`."""
    if mode not in MODES:
        raise UserError(f"{param(name + '_mode')} must be one of {', '.join(MODES)}, got {mode!r}.")
    default_gs, forced, allowed = MODES[mode]
    if forced is not None:
        if bits not in (None, forced):
            raise UserError(f"{mode} stores {forced} bits; drop {param(name + '_bits')} {bits} or use "
                            f"{param(name + '_mode')} affine.")
        bits = forced
    elif bits is None:
        bits = DEFAULT_BITS
    elif bits not in AFFINE_BITS:
        raise UserError(f"{param(name + '_bits')} must be one of {', '.join(map(str, AFFINE_BITS))} for affine, "
                        f"got {bits!r}.")
    gs = default_gs if group_size is None else group_size
    if isinstance(gs, bool) or not isinstance(gs, int) or gs not in allowed:
        raise UserError(f"{param(group_param or name + '_group_size')} must be one of {', '.join(map(str, allowed))} "
                        f"for {mode} (leave it out for {default_gs}), got {gs!r}.")
    return Setting(int(bits), int(gs), mode)


class IntChoice(click.Choice):
    """A choice of whole numbers, shown as ``[2|3|4]`` and given back as an ``int``."""

    def convert(self, value, param, ctx):
        return int(super().convert(str(value), param, ctx))


BITS = IntChoice([str(b) for b in AFFINE_BITS])
MODE = click.Choice(list(MODES))


@dataclass(frozen=True)
class QuantRecipe(Group):
    """What the quantize job is asked for (its option group ``recipe``; fields = its options), checked when built
    and resolved into a :class:`Recipe` by the job.

    ``expert_*``: bits / format / group size of the routed experts (``None`` group size: the mode's default;
    ``None`` bits: the mode's own for mxfp4 / nvfp4 / mxfp8, 4 for affine); ``dense_*``: the same for attention, shared experts,
    dense MLPs, embeddings and head; ``router_bits``: 16 (float) or 8 (8-bit affine); ``cold_layers`` /
    ``cold_bits`` / ``cold_mode``: with a saliency file, that many coldest MoE layers' routed experts get these
    bits and format (default ``expert_mode``), with ``expert_group_size`` — fewer bits than the other experts
    (cold: the least salient layers give up precision first)."""

    expert_bits: int | None = option(None, "Bits of the routed experts (affine).", type=BITS,
                                     default_text="4; mxfp4 / nvfp4 / mxfp8: their own")
    expert_mode: str = option("affine", "Routed experts' format (mxfp4 / nvfp4: 4 bits, mxfp8: 8 bits).", type=MODE)
    expert_group_size: int | None = option(
        None, "Routed experts' (and cold layers') group size: affine 32, 64 or 128; mxfp4 / mxfp8 32; nvfp4 16. "
        "Left out: the mode's default (64, 32, 32, 16).", type=click.INT)
    dense_bits: int | None = option(None, "Bits of attention, shared experts, dense MLPs, embeddings and head.",
                                    type=BITS, default_text="4; mxfp4 / nvfp4 / mxfp8: their own")
    dense_mode: str = option("affine", "Their format.", type=MODE)
    dense_group_size: int | None = option(None, "Their group size (allowed values and default as for "
                                          "--expert-group-size).", type=click.INT)
    router_bits: int = option(16, "16: routers stay in float; 8: 8-bit affine.", type=IntChoice(["16", "8"]))
    cold_layers: int | None = option(None, "How many MoE layers count as cold.", type=click.IntRange(min=1))
    cold_bits: int | None = option(None, "Bits of the cold layers' routed experts: fewer than --expert-bits.",
                                   type=BITS)
    cold_mode: str | None = option(None, "Their format (default --expert-mode).", type=MODE)

    def __post_init__(self) -> None:
        self.check_fields(click.IntRange)  # the counts' ranges first,
        self.settings()  # then each setting's own message (allowed bits, group sizes per mode) before the generic ones
        super().__post_init__()

    def settings(self) -> tuple[Setting, Setting, Setting | None, Setting | None]:
        """``(dense, experts, router, cold)`` :class:`Setting` s (router and cold ``None`` where unused), checked:
        one-line ``UserError`` s naming the field."""
        dense = setting("dense", self.dense_bits, self.dense_group_size, self.dense_mode)
        experts = setting("expert", self.expert_bits, self.expert_group_size, self.expert_mode)
        if self.router_bits not in (8, 16):
            raise UserError(f"{param('router_bits')} must be 16 (kept in float) or 8 (8-bit affine), got "
                            f"{self.router_bits!r}.")
        router = None if self.router_bits == 16 else Setting(8, 64, "affine")
        cold = None if self.cold_layers is None else setting(
            "cold", self.cold_bits, self.expert_group_size, self.cold_mode or self.expert_mode,
            group_param="expert_group_size")
        if cold is not None and (cold.bits > experts.bits or cold == experts):
            what = "the same setting as" if cold == experts else "more bits than"
            raise UserError(f"{param('cold_bits')} {cold.bits} gives the coldest, least salient layers {what} the "
                            f"other routed experts ({cold} vs {experts}): cold layers are the ones that give up "
                            f"precision; pass a {param('cold_bits')} below {experts.bits} (or raise "
                            f"{param('expert_bits')}).")
        return dense, experts, router, cold


@dataclass(frozen=True)
class Recipe:
    dense: Setting
    experts: Setting
    router: Setting | None  # None: kept in float
    cold: Setting | None = None
    cold_layers: tuple[int, ...] = ()  # decoder-layer indices whose routed experts get ``cold``

    def describe(self) -> dict:
        return {"dense": str(self.dense), "experts": str(self.experts),
                "router": "float" if self.router is None else str(self.router),
                "cold_experts": None if self.cold is None else str(self.cold), "cold_layers": list(self.cold_layers)}


def coldest_layers(scores: np.ndarray, moe_layers: list[int], n: int) -> list[int]:
    """The ``n`` MoE layers (decoder indices) whose experts' summed saliency is smallest, coldest first."""
    order = np.argsort(np.asarray(scores, dtype=np.float64).sum(axis=1), kind="stable")
    return [moe_layers[int(i)] for i in order[:n]]


def classes(adapter) -> tuple[dict[str, str], dict[str, int]]:
    """Module path prefixes of the routers and routed experts: ``({path: "router" | "experts"}, {path: layer})``."""
    names = {id(m): name for name, m in adapter.model.named_modules()}
    kinds, layer_of = {}, {}
    for layer, block in zip(adapter.moe_layers(), adapter.blocks()):
        for kind, module in (("router", adapter.router(block)), ("experts", adapter.experts(block))):
            kinds[names[id(module)]] = kind
            layer_of[names[id(module)]] = layer
    return kinds, layer_of


def quantize(adapter, config: dict, recipe: Recipe) -> tuple[dict, dict[str, dict[str, int]], list[str]]:
    """Quantize ``adapter.model`` in place (lazily) by ``recipe`` with mlx-lm's ``quantize_model``.

    Returns ``(new config, {class: {setting: modules}}, paths left in float because their input width is not a
    multiple of the group size)``.
    """
    from mlx_lm.utils import quantize_model

    model = adapter.model
    kinds, layer_of = classes(adapter)
    own = getattr(model, "quant_predicate", None)
    counts: dict[str, dict[str, int]] = {"router": {}, "experts": {}, "dense": {}}
    kept_float: set[str] = set()  # float on purpose: float routers, modules the family's own predicate refuses

    def predicate(path: str, module) -> bool | dict:
        if own is not None and own(path, module) is False:
            kept_float.add(path)
            return False
        owner = next((p for p in kinds if path == p or path.startswith(p + ".")), None)
        kind = kinds.get(owner, "dense")
        chosen = {"router": recipe.router, "dense": recipe.dense}.get(kind, recipe.experts)
        if kind == "experts" and recipe.cold is not None and layer_of[owner] in recipe.cold_layers:
            chosen = recipe.cold
        if chosen is None:
            counts[kind]["float"] = counts[kind].get("float", 0) + 1
            kept_float.add(path)
            return False
        if module.weight.shape[-1] % chosen.group_size:
            return False
        counts[kind][str(chosen)] = counts[kind].get(str(chosen), 0) + 1
        return chosen.params()

    # quantize_model skips a module whose input width is not a multiple of *its* group size before asking the
    # predicate: hand it the smallest group size of the recipe, so the predicate decides with each module's own
    used = [x for x in (recipe.dense, recipe.experts, recipe.router, recipe.cold) if x is not None]
    with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints its bits per weight
        _, new_config = quantize_model(model, config, min(x.group_size for x in used), recipe.dense.bits,
                                       mode=recipe.dense.mode, quant_predicate=predicate)
    new_config["quantization"].update(recipe.dense.params())  # the default: every quantized module has its own
    skipped = [p for p, m in model.named_modules() if hasattr(m, "to_quantized") and p not in kept_float]
    return new_config, counts, sorted(skipped)


def bits_per_weight(model) -> float:
    """mlx-lm's bits per weight of a (lazily) quantized model: stored bits ÷ logical parameters."""
    from mlx_lm.utils import compute_bits_per_weight

    return float(compute_bits_per_weight(model))
