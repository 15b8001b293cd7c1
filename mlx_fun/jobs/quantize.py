"""The ``quantize`` job: MoE-aware mixed precision into a directory plain ``mlx_lm.load`` opens."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from typing import Annotated

import click

from ..core.options import Opt
from ..errors import UserError, param, require_path
from ..experts.selection import METRIC
from ..rewrite.quantize import QuantRecipe
from .common import FORCE_DIR, MODEL, Log, check_moe, job, model_job, quiet


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


@job
def run(
    *,
    model: Annotated[str | Path, MODEL],
    output: Annotated[str | Path, Opt("Directory for the quantized model.")],
    recipe: QuantRecipe = QuantRecipe(),
    saliency: Annotated[str | Path | None, Opt("Saliency .npz from `mlx-fun collect`: the coldest layers' experts get "
                                               "--cold-bits.")] = None,
    metric: Annotated[str, METRIC] = "reap",
    max_shard_size: Annotated[str | int, Opt("Largest output .safetensors file.", type=click.STRING)] = "5GB",
    force: Annotated[bool, FORCE_DIR] = False,
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
    from ..output.model_dir import params_nbytes, write_model_dir
    from ..rewrite import quantize as q
    from ..output.streaming import Snapshot, shard_bytes

    checked = check_moe(model)
    if found := (checked[0].get("quantization") or checked[0].get("quantization_config")):
        raise UserError(f"{param('model')} {model} is already quantized ({_describe(found)}); quantize starts from "
                        f"the float original.")
    dense, experts, router, cold = _settings(recipe, saliency)
    max_shard = shard_bytes(max_shard_size)
    start, warnings = time.perf_counter(), []
    with model_job(model, output=output, kind="dir", force=force, log=log, checked=checked, lazy=True,
                   tokenizer=False) as job_:  # weights only
        res, mdl, config, adapter = job_.res, job_.model, job_.config, job_.adapter
        snapshot = Snapshot(mdl, model, config)
        cold_scores: dict[int, float] = {}
        if saliency is not None:
            cold_scores = _cold(adapter, saliency, recipe.cold_layers, metric, warnings, model)
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
    """``recipe``'s settings (:meth:`~mlx_fun.rewrite.quantize.QuantRecipe.settings`, checked when it was built),
    once the rules between it and ``saliency`` hold: one-line ``UserError`` s before anything loads."""
    r = recipe
    if saliency is not None and (r.cold_layers is None or (r.cold_bits is None and r.cold_mode is None)):
        raise UserError(f"{param('saliency')} needs {param('cold_layers')} N and {param('cold_bits')} B (the N "
                        f"coldest MoE layers' experts get B bits).")
    if saliency is None and (r.cold_layers, r.cold_bits, r.cold_mode) != (None, None, None):
        raise UserError(f"{param('cold_layers')} / {param('cold_bits')} pick layers by saliency; add "
                        f"{param('saliency')} (a .npz from `mlx-fun collect`).")
    require_path("saliency", saliency, "pass a .npz written by `mlx-fun collect`")  # after the rules (tests)
    return r.settings()


def _cold(adapter, saliency, n: int, metric: str, warnings: list[str], model) -> dict[int, float]:
    """Decoder layer → summed saliency of the ``n`` coldest MoE layers (coldest first); a warning in ``warnings``
    when ``saliency`` was collected on other weights than ``model``'s."""
    from ..rewrite.quantize import coldest_layers
    from ..observe.saliency import SaliencyAccumulator

    layers = adapter.moe_layers()
    if not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= len(layers):
        raise UserError(f"{param('cold_layers')} must be 1..{len(layers)} (this model has {len(layers)} MoE layers), "
                        f"got {n!r}.")
    acc = SaliencyAccumulator.load(saliency, name="saliency")
    warnings += acc.check_matches(adapter) + acc.check_provenance(model)
    scores = acc.ranking_scores(metric, over="layers")
    sums = scores.sum(axis=1)
    return {layer: round(float(sums[layers.index(layer)]), 6) for layer in coldest_layers(scores, layers, n)}


def _describe(q: dict) -> str:
    if not isinstance(q, dict):
        return str(q)
    if "bits" in q or "mode" in q:
        return f"{q.get('bits', '?')}-bit {q.get('mode', 'affine')}"
    return str(q.get("quant_method", "quantized"))
