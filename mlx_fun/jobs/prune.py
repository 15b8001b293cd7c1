"""The ``prune`` job (REAP): remove the least salient experts and write a standard mlx-lm directory."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__
from ..errors import UserError, param, require_path
from ..experts.selection import Selection
from .common import Log, check_supported, load_moe, quiet


@dataclass
class PruneResult:
    output: Path
    model: Path
    moe_layers: list[int]
    num_experts: int  # before
    kept: int  # per layer, after
    keep_map: dict[int, list[int]]  # MoE position → kept experts
    seconds: float
    warnings: list[str] = field(default_factory=list)
    bytes_copied: int = 0  # written from the source files without decoding (whole tensors or kept rows)
    bytes_evaluated: int = 0  # computed (tensors mlx-lm rebuilt while loading)
    shards: int = 1


def check_sources(*, saliency, expert_list, selection: Selection, safety_map=None, safety_mode=None,
                  domain_map=None, domain_mode=None) -> None:
    """The argument rules of prune (merge shares the first three)."""
    n_prune = selection.n_prune
    if (saliency is None) == (expert_list is None):
        raise UserError(f"give exactly one of {param('saliency')} (with {param('n_prune')}) or {param('expert_list')}.")
    if saliency is not None and n_prune is None:
        raise UserError(f"{param('saliency')} needs {param('n_prune')} (how many experts to remove).")
    if expert_list is not None and n_prune is not None:
        raise UserError(f"{param('expert_list')} already says which experts to remove; drop {param('n_prune')}.")
    if n_prune == 0:
        raise UserError(f"{param('n_prune')} 0 removes no expert: the output would be an unchanged copy labelled "
                        f"pruned; pass {param('n_prune')} 1 or more.")
    if (safety_map is None) != (safety_mode is None):
        raise UserError(f"{param('safety_map')} and {param('safety_mode')} go together.")
    if (domain_map is None) != (domain_mode is None):
        raise UserError(f"{param('domain_map')} and {param('domain_mode')} go together.")
    if selection.ignore_experts is not None and not selection.model_wide:
        raise UserError(f"{param('ignore_experts')} only works with {param('model_wide')}.")


def run(
    *,
    model: str | Path,
    output: str | Path,
    saliency: str | Path | None = None,
    expert_list: str | Path | None = None,
    selection: Selection = Selection(),
    strategy: str = "bottom",
    safety_map: str | Path | None = None,
    safety_mode: str | None = None,
    domain_map: str | Path | None = None,
    domain_mode: str | None = None,
    max_shard_size: str | int = "5GB",
    force: bool = False,
    progress: bool = False,
    log: Log = quiet,
) -> PruneResult:
    """Prune ``model``'s routed experts by saliency (or an explicit expert list) into ``output``.

    Router rows, correction biases and every expert projection (quantized or not) are sliced; shared experts are
    kept; ``reap_metadata.json`` records the kept experts. Streaming (:mod:`mlx_fun.output.streaming`): the model is
    loaded lazily and written tensor by tensor into shards of at most ``max_shard_size`` — untouched tensors and
    kept expert rows are copied from the source files without being decoded, so memory stays near one tensor.
    The output is reserved before loading and checked for room before writing (:mod:`mlx_fun.core.writer`).

    ``selection`` (:class:`mlx_fun.experts.selection.Selection`): how many experts go and how they are ranked (``n_prune``,
    ``metric``, ``model_wide``, ``min_experts_per_layer``, ``ignore_experts``); ``strategy`` picks them from it.
    """
    from ..core import writer
    from ..output.model_dir import params_nbytes, write_model_dir
    from ..rewrite.prune import expert_rows, prune_model
    from ..observe.saliency import SaliencyAccumulator
    from ..output.streaming import Snapshot, shard_bytes

    check_supported(model)  # before anything else: a wrong --model is the likeliest mistake
    check_sources(saliency=saliency, expert_list=expert_list, selection=selection, safety_map=safety_map,
                  safety_mode=safety_mode, domain_map=domain_map, domain_mode=domain_mode)
    metric, model_wide = selection.metric, selection.model_wide
    max_shard = shard_bytes(max_shard_size)
    for name, path in (("saliency", saliency), ("expert_list", expert_list), ("safety_map", safety_map),
                       ("domain_map", domain_map)):
        require_path(name, path)
    inputs = {param("model"): model, param("saliency"): saliency, param("expert_list"): expert_list,
              param("safety_map"): safety_map, param("domain_map"): domain_map}
    acc = None if saliency is None else SaliencyAccumulator.load(saliency, name="saliency")
    scores = None if acc is None else acc.ranking_scores(metric, over="columns" if model_wide else "experts")
    start = time.perf_counter()
    with writer.output(output, kind="dir", inputs=inputs, force=force) as res:
        mdl, _tokenizer, config, adapter = load_moe(model, lazy=True, tokenizer=False)  # rewrites weights only
        snapshot = Snapshot(mdl, model, config)
        moe_layers, E = adapter.moe_layers(), adapter.num_experts
        keep_map, warnings = select_keep_map(
            adapter, acc=acc, scores=scores, expert_list=expert_list, selection=selection, strategy=strategy,
            safety_map=safety_map, safety_mode=safety_mode, domain_map=domain_map)
        for line in warnings:
            log(f"Warning: {line}")
        rows = expert_rows(adapter, keep_map)
        new_config = prune_model(adapter, keep_map)
        n_kept = adapter.num_experts  # read from the weights: before the writer empties them
        metadata = {
            "original_num_experts": E,
            "pruned_num_experts": n_kept,
            "metric": "expert-list" if expert_list is not None else metric,
            "keep_map": {str(moe_layers[pos]): [int(e) for e in kept] for pos, kept in sorted(keep_map.items())},
            "strategy": strategy if expert_list is None else None,
            "model_wide": model_wide,
            "n_prune": selection.n_prune,
            "source": str(saliency or expert_list),
            "mlx_fun_version": __version__,
        }
        res.require_space(params_nbytes(mdl))
        log(f"Saving pruned model to {output} ...")
        stats = write_model_dir(res, mdl, new_config, source=model, metadata={"reap_metadata.json": metadata},
                                snapshot=snapshot, rows=rows, max_shard_bytes=max_shard, donate=True,
                                progress=progress)
    return PruneResult(Path(output), Path(model), moe_layers, E, n_kept, keep_map,
                       time.perf_counter() - start, warnings, stats.copied, stats.evaluated, stats.shards)


def select_keep_map(adapter, *, acc, scores, expert_list, selection: Selection, strategy, safety_map=None,
                    safety_mode=None, domain_map=None):
    """``(keep_map, warnings)``: the experts to keep per MoE position, from an expert list or from the loaded
    saliency ``acc`` and its checked ``scores`` (:meth:`~mlx_fun.observe.saliency.SaliencyAccumulator.ranking_scores`), with
    safety / domain protection or targeting."""
    from ..experts.expert_files import load_expert_list, load_report_experts, merge_expert_sets
    from ..experts.selection import check_keep_counts, parse_expert_ranges, select_experts

    moe_layers, E = adapter.moe_layers(), adapter.num_experts
    warnings: list[str] = []
    if expert_list is not None:
        keep_map = load_expert_list(expert_list, len(moe_layers), E, moe_layers)
    else:
        warnings += acc.check_matches(adapter)
        protected_sets, targeted = [], None
        if safety_map is not None:
            safety = load_report_experts(safety_map, "safety", moe_layers, E)
            if safety_mode == "protect":
                protected_sets.append(safety)
            else:
                targeted = safety
        if domain_map is not None:
            protected_sets.append(load_report_experts(domain_map, "domain", moe_layers, E))
        keep_map = select_experts(
            scores, selection.n_prune, top_k=adapter.top_k, strategy=strategy, model_wide=selection.model_wide,
            min_experts_per_layer=selection.min_experts_per_layer,
            ignore_experts=parse_expert_ranges(selection.ignore_experts) if selection.ignore_experts else None,
            protected=merge_expert_sets(*protected_sets) if protected_sets else None, targeted=targeted,
            groups=adapter.groups, moe_layer_indices=moe_layers,
        )
    if expert_list is not None and all(len(kept) == E for kept in keep_map.values()):
        raise UserError(f"{param('expert_list')} {expert_list} removes no expert from any layer: the output would be "
                        f"an unchanged copy labelled pruned; list the experts to remove.")
    warnings += check_keep_counts(keep_map, E, adapter.top_k, groups=adapter.groups, moe_layer_indices=moe_layers)
    return keep_map, warnings
