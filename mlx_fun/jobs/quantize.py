"""The ``quantize`` job: MoE-aware mixed precision into a directory plain ``mlx_lm.load`` opens."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError, param, require_path
from ..rewrite.quantize import QuantRecipe
from .common import Log, check_supported, load_moe, quiet


@dataclass
class QuantizeResult:
    output: Path
    model: Path
    recipe: dict  # class → setting (str), cold layers
    modules: dict[str, dict[str, int]]  # router / experts / dense → setting → modules
    bits_per_weight: float
    seconds: float
    cold_layer_scores: dict[int, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def run(
    *,
    model: str | Path,
    output: str | Path,
    recipe: QuantRecipe = QuantRecipe(),
    saliency: str | Path | None = None,
    metric: str = "reap",
    max_shard_size: str | int = "5GB",
    force: bool = False,
    progress: bool = False,
    log: Log = quiet,
) -> QuantizeResult:
    """Quantize the float MoE ``model`` into ``output`` by ``recipe``
    (:class:`mlx_fun.rewrite.quantize.QuantRecipe`): routed experts at ``recipe.expert_*``; attention, shared
    experts, dense MLPs, embeddings and head at ``recipe.dense_*``; each router kept in float
    (``recipe.router_bits=16``) or 8-bit affine. With ``saliency`` (a ``collect`` file), the ``recipe.cold_layers``
    MoE layers whose experts are least salient (summed ``metric``) get ``recipe.cold_bits`` (``recipe.cold_mode``,
    default ``recipe.expert_mode``) for their routed experts — per layer, the finest granularity mlx-lm's loader
    allows (:mod:`mlx_fun.rewrite.quantize`). Lazy load, lazy quantization, written tensor by tensor
    (:mod:`mlx_fun.output.streaming`).
    """
    from ..core import writer
    from ..output.model_dir import params_nbytes, write_model_dir
    from ..rewrite import quantize as q
    from ..output.streaming import Snapshot, shard_bytes

    config = check_supported(model)
    if found := (config.get("quantization") or config.get("quantization_config")):
        raise UserError(f"{param('model')} {model} is already quantized ({_describe(found)}); quantize starts from "
                        f"the float original.")
    dense, experts, router, cold = _settings(recipe, saliency)
    max_shard = shard_bytes(max_shard_size)
    start, warnings = time.perf_counter(), []
    with writer.output(output, kind="dir", inputs={param("model"): model, param("saliency"): saliency},
                       force=force) as res:
        mdl, _tok, config, adapter = load_moe(model, lazy=True, log=log, tokenizer=False)  # weights only
        snapshot = Snapshot(mdl, model, config)
        cold_scores: dict[int, float] = {}
        if saliency is not None:
            cold_scores = _cold(adapter, saliency, recipe.cold_layers, metric, warnings)
        resolved = q.Recipe(dense, experts, router, cold, tuple(cold_scores))
        new_config, modules, skipped = q.quantize(adapter, config, resolved)
        if skipped:
            warnings.append(f"{len(skipped)} module(s) stay in float: their input width is not a multiple of the "
                            f"group size (e.g. {skipped[0]}).")
        bpw = q.bits_per_weight(mdl)
        for line in warnings:
            log(f"Warning: {line}")
        meta = {"recipe": resolved.describe(), "modules": modules, "bits_per_weight": round(bpw, 4),
                "saliency": None if saliency is None else {"file": str(saliency), "metric": metric,
                                                           "cold_layer_scores": {str(k): v for k, v in cold_scores.items()}},
                "float_modules": skipped}
        res.require_space(params_nbytes(mdl))
        log(f"Saving quantized model to {output} ...")
        write_model_dir(res, mdl, new_config, source=model, metadata={"quantize_metadata.json": meta},
                        snapshot=snapshot, max_shard_bytes=max_shard, donate=True, progress=progress)
    return QuantizeResult(Path(output), Path(model), resolved.describe(), modules, bpw, time.perf_counter() - start,
                          cold_scores, warnings)


def _settings(recipe: QuantRecipe, saliency):
    """``(dense, experts, router, cold)`` :class:`~mlx_fun.rewrite.quantize.Setting` s of ``recipe`` (router and
    cold ``None`` where unused), checked before anything loads: one-line ``UserError`` s naming the field."""
    from ..rewrite import quantize as q

    r = recipe
    dense = q.setting("dense", r.dense_bits, r.dense_group_size, r.dense_mode)
    experts = q.setting("expert", r.expert_bits, r.expert_group_size, r.expert_mode)
    if r.router_bits not in (8, 16):
        raise UserError(f"{param('router_bits')} must be 16 (kept in float) or 8 (8-bit affine), got "
                        f"{r.router_bits!r}.")
    router = None if r.router_bits == 16 else q.Setting(8, 64, "affine")
    if saliency is not None and (r.cold_layers is None or (r.cold_bits is None and r.cold_mode is None)):
        raise UserError(f"{param('saliency')} needs {param('cold_layers')} N and {param('cold_bits')} B (the N "
                        f"coldest MoE layers' experts get B bits).")
    if saliency is None and (r.cold_layers, r.cold_bits, r.cold_mode) != (None, None, None):
        raise UserError(f"{param('cold_layers')} / {param('cold_bits')} pick layers by saliency; add "
                        f"{param('saliency')} (a .npz from `mlx-fun collect`).")
    require_path("saliency", saliency, "pass a .npz written by `mlx-fun collect`")
    cold = None if r.cold_layers is None else q.setting("cold", r.cold_bits, r.expert_group_size,
                                                        r.cold_mode or r.expert_mode, group_param="expert_group_size")
    if cold is not None and (cold.bits > experts.bits or cold == experts):
        what = "the same setting as" if cold == experts else "more bits than"
        raise UserError(f"{param('cold_bits')} {cold.bits} gives the coldest, least salient layers {what} the other "
                        f"routed experts ({cold} vs {experts}): cold layers are the ones that give up precision; "
                        f"pass a {param('cold_bits')} below {experts.bits} (or raise {param('expert_bits')}).")
    return dense, experts, router, cold


def _cold(adapter, saliency, n: int, metric: str, warnings: list[str]) -> dict[int, float]:
    """Decoder layer → summed saliency of the ``n`` coldest MoE layers (coldest first)."""
    from ..rewrite.quantize import coldest_layers
    from ..observe.saliency import SaliencyAccumulator

    layers = adapter.moe_layers()
    if not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= len(layers):
        raise UserError(f"{param('cold_layers')} must be 1..{len(layers)} (this model has {len(layers)} MoE layers), "
                        f"got {n!r}.")
    acc = SaliencyAccumulator.load(saliency, name="saliency")
    warnings += acc.check_matches(adapter)
    scores = acc.ranking_scores(metric, over="layers")
    sums = scores.sum(axis=1)
    return {layer: round(float(sums[layers.index(layer)]), 6) for layer in coldest_layers(scores, layers, n)}


def _describe(q: dict) -> str:
    if not isinstance(q, dict):
        return str(q)
    if "bits" in q or "mode" in q:
        return f"{q.get('bits', '?')}-bit {q.get('mode', 'affine')}"
    return str(q.get("quant_method", "quantized"))
