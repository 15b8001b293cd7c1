"""The ``merge`` job (REAM): fold the least salient experts into the most salient ones and write an mlx-lm dir."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__
from ..errors import UserError, param
from .common import (Log, apply_dispatch, check_supported, forward_budget, load_moe, quiet, require_path,
                     warn_past_context)


@dataclass
class MergeResult:
    output: Path
    model: Path
    moe_layers: list[int]
    num_experts: int  # before
    kept: int  # centroids per layer
    metadata: dict  # ream_metadata.json
    seconds: float
    warnings: list[str] = field(default_factory=list)


def run(
    *,
    model: str | Path,
    dataset: str | Path,
    output: str | Path,
    saliency: str | Path | None = None,
    expert_list: str | Path | None = None,
    n_prune: int | None = None,
    metric: str = "reap",
    model_wide: bool = False,
    min_experts_per_layer: int = 1,
    ignore_experts: str | None = None,
    similarity_mode: str = "gated",
    alignment: str = "hungarian",
    max_group_size: int = 16,
    max_samples: int = 64,
    max_tokens: int = 2048,
    max_similarity_tokens: int = 512,
    max_alignment_tokens: int = 256,
    text_key: str = "content",
    batch_size: int = 8,
    seed: int | None = None,
    dispatch: str = "auto",
    dispatch_table: str | Path | None = None,
    token_budget: int | None = None,
    force: bool = False,
    progress: bool = False,
    log: Log = quiet,
) -> MergeResult:
    """Merge ``model``'s routed experts around the most salient ones (REAM) into ``output``.

    Centroids: the ``E − n_prune`` most salient experts of ``saliency``, or the kept experts of ``expert_list``
    (``saliency`` then only weights the averages). Calibration hidden states are carried through the layers by the
    rewrite driver (:class:`mlx_fun.rewrite.driver.LayerDriver`); quantized experts are re-quantized with their own
    bits / group size / mode. See :mod:`mlx_fun.rewrite.merge` for the method.
    """
    from .. import engine, writer
    from ..data import load_samples, pad_id
    from ..io import write_model_dir
    from ..rewrite.merge import check_group_room, check_max_group_size, merge_model, select_centroids
    from ..rewrite.prune import pruned_nbytes
    from ..saliency import SaliencyAccumulator
    from ..selection import check_keep_counts, parse_expert_ranges

    check_supported(model)  # before anything else: a wrong --model is the likeliest mistake
    if saliency is None and expert_list is None:
        raise UserError(f"give {param('saliency')} (with {param('n_prune')}) or {param('expert_list')} to choose the "
                        f"centroids.")
    if expert_list is None and n_prune is None:
        raise UserError(f"{param('saliency')} needs {param('n_prune')} (how many experts to merge away per layer).")
    if expert_list is not None and n_prune is not None:
        raise UserError(f"{param('expert_list')} already says which experts stay as centroids; drop "
                        f"{param('n_prune')}.")
    if ignore_experts is not None and not model_wide:
        raise UserError(f"{param('ignore_experts')} only works with {param('model_wide')}.")
    if model_wide and expert_list is not None:
        raise UserError(f"{param('model_wide')} selects centroids from {param('saliency')}; it does not apply to "
                        f"{param('expert_list')}.")
    check_max_group_size(max_group_size)
    for name, path in (("saliency", saliency), ("expert_list", expert_list), ("dataset", dataset)):
        require_path(name, path)
    inputs = {param("model"): model, param("saliency"): saliency, param("expert_list"): expert_list,
              param("dataset"): dataset}
    start = time.perf_counter()
    with writer.output(output, kind="dir", inputs=inputs, force=force) as res:
        mdl, tokenizer, config, adapter = load_moe(model, lazy=True, log=log)
        # no dequantized-experts cache: merging rewrites the experts it would hold
        report = apply_dispatch(mdl, dispatch=dispatch, dispatch_table=dispatch_table, dequant_cache=0, log=log)
        moe_layers, E = adapter.moe_layers(), adapter.num_experts
        scores, warnings = None, []
        if saliency is not None:
            acc = SaliencyAccumulator.load(saliency, name="saliency")
            warnings += acc.check_matches(adapter)
            scores = acc.ranking_scores(metric, over="columns" if model_wide else "experts")
        if expert_list is not None:
            from ..expert_files import load_expert_list

            keep_map = load_expert_list(expert_list, len(moe_layers), E, moe_layers)
        else:
            keep_map = select_centroids(
                adapter, scores, n_prune, model_wide=model_wide, min_experts_per_layer=min_experts_per_layer,
                ignore_experts=parse_expert_ranges(ignore_experts, E) if ignore_experts else None)
        warnings += check_keep_counts(keep_map, E, adapter.top_k, groups=adapter.groups, moe_layer_indices=moe_layers)
        n_kept = len(keep_map[0])
        check_group_room(n_kept, E, max_group_size)
        for line in warnings:
            log(f"Warning: {line}")
        samples = load_samples(dataset, tokenizer, max_samples=max_samples, max_tokens=max_tokens, text_key=text_key,
                               seed=seed)
        log(f"{adapter.model_type}: {len(moe_layers)} MoE layers × {E} experts → {n_kept} centroids; "
            f"{len(samples)} samples, {engine.total_tokens(samples):,} tokens; similarity {similarity_mode}, "
            f"alignment {alignment}")
        warnings += warn_past_context(samples, config, log)
        res.require_space(pruned_nbytes(adapter, n_kept))
        metadata = merge_model(
            mdl, adapter, samples, keep_map=keep_map, saliency=scores, metric=metric,
            similarity_mode=similarity_mode, alignment=alignment, max_group_size=max_group_size,
            max_similarity_tokens=max_similarity_tokens, max_alignment_tokens=max_alignment_tokens, seed=seed,
            batch_size=batch_size, pad_id=pad_id(tokenizer),
            token_budget=forward_budget(token_budget, config=config, dispatch_mode=report.mode), progress=progress,
        )
        metadata.update(n_prune=n_prune, model_wide=model_wide, source=str(saliency or expert_list),
                        expert_list=None if expert_list is None else str(expert_list), dataset=str(dataset),
                        mlx_fun_version=__version__)
        log(f"Saving merged model to {output} ...")
        write_model_dir(res, mdl, adapter.config, source=model, metadata={"ream_metadata.json": metadata})
    return MergeResult(Path(output), Path(model), moe_layers, E, n_kept, metadata, time.perf_counter() - start,
                       warnings)

