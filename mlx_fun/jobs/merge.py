"""The ``merge`` job (REAM): fold the least salient experts into the most salient ones and write an mlx-lm dir."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__
from ..errors import UserError, param, require_path, require_whole
from ..rewrite.merge_options import Ream
from ..experts.selection import Selection
from ..settings import RunSettings
from .common import Log, check_supported, load_moe, quiet, warn_past_context


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
    selection: Selection = Selection(),
    ream: Ream = Ream(),
    max_samples: int = 64,
    max_tokens: int = 2048,
    text_key: str = "content",
    batch_size: int = 8,
    seed: int | None = None,
    settings: RunSettings = RunSettings(),
    force: bool = False,
    log: Log = quiet,
) -> MergeResult:
    """Merge ``model``'s routed experts around the most salient ones (REAM) into ``output``.

    Centroids: the ``E − selection.n_prune`` most salient experts of ``saliency``, or the kept experts of
    ``expert_list`` (``saliency`` then only weights the averages). Calibration hidden states are carried through the
    layers by the rewrite driver (:class:`mlx_fun.rewrite.driver.LayerDriver`); quantized experts are re-quantized
    with their own bits / group size / mode. See :mod:`mlx_fun.rewrite.merge` for the method.

    ``selection`` (:class:`mlx_fun.experts.selection.Selection`): how many experts are merged away and how the centroids
    are ranked; ``ream`` (:class:`mlx_fun.rewrite.merge_options.Ream`): similarity, alignment and group size;
    ``settings`` (:class:`mlx_fun.settings.RunSettings`): dispatch, table, token budget and progress of the
    calibration forwards — no ``dequant_cache`` (merging rewrites the expert weights such a cache would hold).
    """
    import dataclasses

    from ..model import engine
    from ..core import writer
    from ..datasets.samples import load_samples, pad_id
    from ..output.model_dir import write_model_dir
    from ..rewrite.merge import check_group_room, merge_model
    from ..rewrite.prune import pruned_nbytes

    check_supported(model)  # before anything else: a wrong --model is the likeliest mistake
    _check(saliency, expert_list, selection, ream, settings)
    require_whole("seed", seed, 0, none_ok=True)  # numpy's generator takes no negative seed
    for name, path in (("saliency", saliency), ("expert_list", expert_list), ("dataset", dataset)):
        require_path(name, path)
    inputs = {param("model"): model, param("saliency"): saliency, param("expert_list"): expert_list,
              param("dataset"): dataset}
    start = time.perf_counter()
    with writer.output(output, kind="dir", inputs=inputs, force=force) as res:
        mdl, tokenizer, config, adapter = load_moe(model, lazy=True, log=log)
        report = settings.apply(mdl, log=log)  # dequant_cache is 0 (checked): merging rewrites the experts
        moe_layers, E = adapter.moe_layers(), adapter.num_experts
        keep_map, scores, warnings = _centroids(adapter, saliency, expert_list, selection)
        n_kept = len(keep_map[0])
        check_group_room(n_kept, E, ream.max_group_size)
        for line in warnings:
            log(f"Warning: {line}")
        samples = load_samples(dataset, tokenizer, max_samples=max_samples, max_tokens=max_tokens, text_key=text_key,
                               seed=seed)
        log(f"{adapter.model_type}: {len(moe_layers)} MoE layers × {E} experts → {n_kept} centroids; "
            f"{len(samples)} samples, {engine.total_tokens(samples):,} tokens; similarity {ream.similarity_mode}, "
            f"alignment {ream.alignment}")
        warnings += warn_past_context(samples, config, log)
        res.require_space(pruned_nbytes(adapter, n_kept))
        metadata = merge_model(
            mdl, adapter, samples, keep_map=keep_map, saliency=scores, metric=selection.metric,
            **dataclasses.asdict(ream), seed=seed, batch_size=batch_size, pad_id=pad_id(tokenizer),
            token_budget=settings.budget(config, dispatch_mode=report.mode), progress=settings.progress,
        )
        metadata.update(n_prune=selection.n_prune, model_wide=selection.model_wide,
                        source=str(saliency or expert_list),
                        expert_list=None if expert_list is None else str(expert_list), dataset=str(dataset),
                        mlx_fun_version=__version__)
        log(f"Saving merged model to {output} ...")
        write_model_dir(res, mdl, adapter.config, source=model, metadata={"ream_metadata.json": metadata})
    return MergeResult(Path(output), Path(model), moe_layers, E, n_kept, metadata, time.perf_counter() - start,
                       warnings)


def _check(saliency, expert_list, selection: Selection, ream: Ream, settings: RunSettings) -> None:
    """merge's argument rules, one-line ``UserError`` s before anything loads."""
    from ..rewrite.merge import check_max_group_size

    n_prune = selection.n_prune
    if saliency is None and expert_list is None:
        raise UserError(f"give {param('saliency')} (with {param('n_prune')}) or {param('expert_list')} to choose the "
                        f"centroids.")
    if expert_list is None and n_prune is None:
        raise UserError(f"{param('saliency')} needs {param('n_prune')} (how many experts to merge away per layer).")
    if expert_list is not None and n_prune is not None:
        raise UserError(f"{param('expert_list')} already says which experts stay as centroids; drop "
                        f"{param('n_prune')}.")
    if n_prune == 0:
        raise UserError(f"{param('n_prune')} 0 merges no expert away: the output would be an unchanged copy labelled "
                        f"merged; pass {param('n_prune')} 1 or more.")
    if selection.ignore_experts is not None and not selection.model_wide:
        raise UserError(f"{param('ignore_experts')} only works with {param('model_wide')}.")
    if selection.model_wide and expert_list is not None:
        raise UserError(f"{param('model_wide')} selects centroids from {param('saliency')}; it does not apply to "
                        f"{param('expert_list')}.")
    check_max_group_size(ream.max_group_size)
    settings.check()
    if settings.dequant_bytes():
        raise UserError(f"merge takes no {param('dequant_cache')} (got {settings.dequant_cache!r}): it rewrites the "
                        f"expert weights a dequantized-experts cache would hold; leave it at 0.")


def _centroids(adapter, saliency, expert_list, selection: Selection):
    """``(keep_map, scores, warnings)``: the centroids per MoE position, from ``expert_list`` or the ``saliency``
    ranking (``scores``: its checked ranking scores, ``None`` without ``saliency``)."""
    from ..rewrite.merge import select_centroids
    from ..observe.saliency import SaliencyAccumulator
    from ..experts.selection import check_keep_counts, parse_expert_ranges

    moe_layers, E = adapter.moe_layers(), adapter.num_experts
    scores, warnings = None, []
    if saliency is not None:
        acc = SaliencyAccumulator.load(saliency, name="saliency")
        warnings += acc.check_matches(adapter)
        scores = acc.ranking_scores(selection.metric, over="columns" if selection.model_wide else "experts")
    if expert_list is not None:
        from ..experts.expert_files import load_expert_list

        keep_map = load_expert_list(expert_list, len(moe_layers), E, moe_layers)
        if all(len(kept) == E for kept in keep_map.values()):
            raise UserError(f"{param('expert_list')} {expert_list} keeps every expert of every layer, so nothing "
                            f"would be merged: the output would be an unchanged copy labelled merged; list the "
                            f"experts to merge away.")
    else:
        ignore = selection.ignore_experts
        keep_map = select_centroids(
            adapter, scores, selection.n_prune, model_wide=selection.model_wide,
            min_experts_per_layer=selection.min_experts_per_layer,
            ignore_experts=parse_expert_ranges(ignore, E) if ignore else None)
    warnings += check_keep_counts(keep_map, E, adapter.top_k, groups=adapter.groups, moe_layer_indices=moe_layers)
    return keep_map, scores, warnings
