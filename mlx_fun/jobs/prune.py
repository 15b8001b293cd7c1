"""The ``prune`` job (REAP): remove the least salient experts and write a standard mlx-lm directory."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from typing import Annotated

import click

from .. import __version__
from ..core.options import Opt
from ..errors import UserError, param
from ..experts.selection import STRATEGIES, Selection
from ..model.lora import ADAPTER_PATH
from .common import FORCE_DIR, MODEL, Loaded, Log, check_moe, job, model_job, quiet


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
    """The argument rules of prune between its parameters (merge shares the first three; the rules within
    ``selection`` held when it was built: :class:`~mlx_fun.experts.selection.Selection`)."""
    n_prune = selection.n_prune
    if (saliency is None) == (expert_list is None):
        raise UserError(f"give exactly one of {param('saliency')} (with {param('n_prune')}) or {param('expert_list')}.")
    if saliency is not None and n_prune is None:
        raise UserError(f"{param('saliency')} needs {param('n_prune')} (how many experts to remove).")
    if expert_list is not None and n_prune is not None:
        raise UserError(f"{param('expert_list')} already says which experts to remove; drop {param('n_prune')}.")
    if (safety_map is None) != (safety_mode is None):
        raise UserError(f"{param('safety_map')} and {param('safety_mode')} go together.")
    if (domain_map is None) != (domain_mode is None):
        raise UserError(f"{param('domain_map')} and {param('domain_mode')} go together.")


#: a report of experts per layer (safety-scan / domain-scan)
def _report(kind: str) -> Opt:
    return Opt(f"{kind} report JSON listing experts per layer (format: README, Report files).",
               type=click.Path(), missing=f"pass the JSON report `mlx-fun {kind.lower()}-scan` wrote")


SALIENCY = Opt("Saliency .npz from `mlx-fun collect`.", missing="pass the .npz `mlx-fun collect` wrote")
EXPERT_LIST = Opt("JSON/CSV list of experts to keep or remove per layer (see README); replaces --saliency/--n-prune.",
                  missing="pass a JSON or CSV expert list (see README)")
MAX_SHARD_SIZE = Opt("Largest output .safetensors file (e.g. 5GB, 500MB); more become shards with an index.",
                     type=click.STRING)


@job
def run(
    *,
    model: Annotated[str | Path, MODEL],
    adapter_path: Annotated[str | Path | None, ADAPTER_PATH] = None,
    saliency: Annotated[str | Path | None, SALIENCY] = None,
    expert_list: Annotated[str | Path | None, EXPERT_LIST] = None,
    output: Annotated[str | Path, Opt("Directory for the pruned model (must not be --model).")],
    selection: Selection = Selection(),
    strategy: Annotated[str, Opt("bottom: remove the lowest scores; strided: spread removals over the saliency "
                                 "range.", type=click.Choice(STRATEGIES))] = "bottom",
    safety_map: Annotated[str | Path | None, _report("Safety")] = None,
    safety_mode: Annotated[str | None, Opt("protect: never prune safety-critical experts; target: prune them first.",
                                           type=click.Choice(["protect", "target"]))] = None,
    domain_map: Annotated[str | Path | None, _report("Domain")] = None,
    domain_mode: Annotated[str | None, Opt("protect: never prune domain experts.",
                                           type=click.Choice(["protect"]))] = None,
    max_shard_size: Annotated[str | int, MAX_SHARD_SIZE] = "5GB",
    force: Annotated[bool, FORCE_DIR] = False,
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
    ``adapter_path``: a LoRA adapter fused into the model as it loads (:mod:`mlx_fun.model.lora`, ``mlx_lm.fuse``'s
    arithmetic): the fine-tune is what is pruned and written (its fused tensors are computed, never copied from the
    base's files); ``reap_metadata.json`` and the model card name the adapter.
    """
    from ..observe.saliency import SaliencyAccumulator
    from ..output.streaming import shard_bytes

    checked = check_moe(model)  # before anything else: a wrong --model is the likeliest mistake
    check_sources(saliency=saliency, expert_list=expert_list, selection=selection, safety_map=safety_map,
                  safety_mode=safety_mode, domain_map=domain_map, domain_mode=domain_mode)
    max_shard = shard_bytes(max_shard_size)
    acc = None if saliency is None else SaliencyAccumulator.load(saliency, name="saliency")
    scores = None if acc is None else acc.ranking_scores(selection.metric,
                                                         over="columns" if selection.model_wide else "experts")
    start = time.perf_counter()
    with model_job(model, output=output, kind="dir", force=force, log=log, checked=checked, lazy=True,
                   tokenizer=False, adapter_path=adapter_path) as job_:  # rewrites weights only
        keep_map, warnings = select_keep_map(
            job_.adapter, acc=acc, scores=scores, expert_list=expert_list, selection=selection, strategy=strategy,
            safety_map=safety_map, safety_mode=safety_mode, domain_map=domain_map)
        warnings += [] if acc is None else acc.check_provenance(model)  # collected on other weights?
        for line in warnings:
            log(f"Warning: {line}")
        return _write(job_, model=model, output=output, keep_map=keep_map, source=saliency or expert_list,
                      expert_list=expert_list, selection=selection, strategy=strategy, max_shard=max_shard,
                      progress=progress, log=log, start=start, warnings=warnings, adapter_path=adapter_path)


def _write(job_: Loaded, *, model, output, keep_map, source, expert_list, selection: Selection, strategy: str,
           max_shard: int, progress: bool, log: Log, start: float, warnings: list[str],
           adapter_path=None) -> PruneResult:
    """Prune the loaded model to ``keep_map`` and stream it into ``job_.res`` with ``reap_metadata.json``."""
    from ..model import lora
    from ..output.model_dir import params_nbytes, write_model_dir
    from ..output.streaming import Snapshot
    from ..rewrite.prune import expert_rows, prune_model

    mdl, adapter = job_.model, job_.adapter
    snapshot = Snapshot(mdl, model, job_.config)
    moe_layers, E = adapter.moe_layers(), adapter.num_experts
    rows = expert_rows(adapter, keep_map)
    new_config = prune_model(adapter, keep_map)
    n_kept = adapter.num_experts  # read from the weights: before the writer empties them
    metadata = {
        "original_num_experts": E,
        "pruned_num_experts": n_kept,
        "metric": "expert-list" if expert_list is not None else selection.metric,
        "keep_map": {str(moe_layers[pos]): [int(e) for e in kept] for pos, kept in sorted(keep_map.items())},
        "strategy": strategy if expert_list is None else None,
        "model_wide": selection.model_wide,
        "n_prune": selection.n_prune,
        "source": str(source),
        "mlx_fun_version": __version__,
        **lora.recorded(adapter_path),
    }
    job_.res.require_space(params_nbytes(mdl))
    log(f"Saving pruned model to {output} ...")
    stats = write_model_dir(job_.res, mdl, new_config, source=model, metadata={"reap_metadata.json": metadata},
                            snapshot=snapshot, rows=rows, max_shard_bytes=max_shard, donate=True, progress=progress)
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
