"""The ``merge`` job (REAM): fold the least salient experts into the most salient ones and write an mlx-lm dir."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

from typing import Annotated

from .. import __version__
from ..core.options import Opt
from ..datasets.calibration import Calibration
from ..errors import UserError, param
from ..experts.selection import Selection
from ..model.lora import ADAPTER_PATH
from ..rewrite.merge_options import Ream
from ..settings import RunSettings
from .common import (DATASET, FORCE_DIR, MODEL, Loaded, Log, StreamPlan, check_moe, job, model_job, quiet,
                     stream_checkpoint, stream_choice, stream_layers_opt, warn_past_context)


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
    streamed: bool = False  # run one decoder layer at a time (--stream-layers)
    peak_bytes: int = 0  # this process's peak resident memory at the end


SALIENCY = Opt("Saliency .npz from `mlx-fun collect`, read only with --saliency-source file: picks the centroids "
               "(with --n-prune) and weights the averages (with --expert-list: only weights them). With the default "
               "--saliency-source layerwise it is not read (a warning says so).",
               missing="pass the .npz `mlx-fun collect` wrote")
EXPERT_LIST = Opt("JSON/CSV list of experts per layer; its kept experts are the centroids (replaces --n-prune).",
                  missing="pass a JSON or CSV expert list (see README)")
CALIBRATION_DATA = Opt("Calibration data for similarity and alignment (JSONL or a directory, as for collect).",
                       missing=DATASET.missing)


@job
def run(
    *,
    model: Annotated[str | Path, MODEL],
    adapter_path: Annotated[str | Path | None, ADAPTER_PATH] = None,
    saliency: Annotated[str | Path | None, SALIENCY] = None,
    expert_list: Annotated[str | Path | None, EXPERT_LIST] = None,
    dataset: Annotated[str | Path, CALIBRATION_DATA],
    output: Annotated[str | Path, Opt("Directory for the merged model (must not be --model).")],
    selection: Selection = Selection(),
    ream: Ream = Ream(),
    calibration: Calibration = Calibration(max_samples=64, batch_size=8),
    force: Annotated[bool, FORCE_DIR] = False,
    settings: RunSettings = RunSettings(),
    stream_layers: Annotated[bool | None, stream_layers_opt(same="the same merged weights, bit for bit",
                                                            resumes=True)] = None,
    log: Log = quiet,
) -> MergeResult:
    """Merge ``model``'s routed experts around the most salient ones (REAM) into ``output``.

    Centroids: the ``E − selection.n_prune`` most salient experts of each layer, or the kept experts of
    ``expert_list``. The saliency that ranks them and weights the averages (``ream.saliency_source``): ``layerwise``
    (the default, REAM's own: measured per layer during the merge, :mod:`mlx_fun.rewrite.ream_saliency`;
    ``saliency`` is then not read, and a warning says so) or ``file`` (``saliency``, ranked up front). Calibration hidden states are carried through the
    layers by the layered driver (:class:`mlx_fun.model.layered.LayerDriver`); quantized experts are re-quantized
    with their own bits / group size / mode. See :mod:`mlx_fun.rewrite.merge` for the method.

    ``selection`` (:class:`mlx_fun.experts.selection.Selection`): how many experts are merged away and how the centroids
    are ranked; ``ream`` (:class:`mlx_fun.rewrite.merge_options.Ream`): similarity, alignment and group size;
    ``calibration`` (:class:`mlx_fun.datasets.calibration.Calibration`): the samples, their batches and the seed of
    the sample and token subsets (its fields may also be given by name: ``max_samples=32``);
    ``settings`` (:class:`mlx_fun.settings.RunSettings`): dispatch, table, token budget and progress of the
    calibration forwards — no ``dequant_cache`` (merging rewrites the expert weights such a cache would hold).

    ``stream_layers`` (None: when the model's weights exceed :func:`mlx_fun.runtime.memory.available_bytes`): one
    decoder layer's weights in memory at a time (:func:`mlx_fun.rewrite.merge.merge_model` with a checkpoint):
    each layer, once merged, is written to the checkpoint in ``.<output name>.stream/`` beside ``output``
    (:mod:`mlx_fun.observe.checkpoint`, with the hidden states after it: it survives a kill or Ctrl-C), which
    rerunning the same command resumes from; the output is assembled from those files (their bytes copied) and the
    checkpoint removed once it is written. The merged weights equal the in-memory merge's bit for bit.
    ``adapter_path``: a LoRA adapter fused into the model as it loads (:mod:`mlx_fun.model.lora`, ``mlx_lm.fuse``'s
    arithmetic), so the merge measures and writes the fine-tuned model; ``ream_metadata.json`` and the model card
    name the adapter.
    """
    checked = check_moe(model)  # before anything else: a wrong --model is the likeliest mistake
    _check(saliency, expert_list, selection, settings, ream)
    plan = stream_choice(stream_layers, [(model, checked[1], checked[0])], doing="merging", log=log,
                         tokens=calibration.max_samples * calibration.max_tokens)
    stream = plan.layers
    start = time.perf_counter()
    with model_job(model, output=output, kind="dir", force=force, settings=settings, log=log, checked=checked,
                   lazy=True, adapter_path=adapter_path,
                   checkpointed=stream) as job_:  # dequant_cache is 0 (checked): merging rewrites
        result = _merge(job_, model=model, saliency=saliency, expert_list=expert_list, dataset=dataset,
                        output=output, selection=selection, ream=ream, calibration=calibration, settings=settings,
                        log=log, start=start, plan=plan, adapter_path=adapter_path)
    return result


def _merge(job_: Loaded, *, model, saliency, expert_list, dataset, output, selection: Selection, ream: Ream,
           calibration: Calibration, settings: RunSettings, log: Log, start: float, plan: StreamPlan,
           adapter_path=None) -> MergeResult:
    """The merge of :func:`run` on the loaded model, written into ``job_.res`` with ``ream_metadata.json``
    (``plan.layers``: one decoder layer at a time, resumable, the output assembled from the checkpoint's layers;
    ``plan.spill``: the hidden states carried in files)."""
    from ..datasets.samples import pad_id
    from ..model import engine, lora
    from ..output.model_dir import dir_size, write_model_dir
    from ..rewrite.merge import check_group_room, merge_model
    from ..rewrite.prune import pruned_nbytes
    from ..runtime.memory import peak_rss_bytes

    adapter, stream = job_.adapter, plan.layers
    moe_layers, E = adapter.moe_layers(), adapter.num_experts
    layerwise, warnings = ream.saliency_source == "layerwise", []
    if layerwise and (saliency is not None or selection.metric != "reap"):
        unread = (f"{param('saliency')} {saliency}" if saliency is not None else f"{param('metric')} "
                  f"{selection.metric}")
        warnings.append(f"{unread} is not read: with {param('saliency_source')} layerwise (the default, REAM's own) "
                        f"each layer's saliency is measured during the merge; pass {param('saliency_source')} file to "
                        f"rank and weight by the file.")
        saliency = None
    keep_map, scores, more = _centroids(adapter, saliency, expert_list, selection, model)
    warnings += more
    n_kept = len(keep_map[0])
    check_group_room(n_kept, E, ream.max_group_size)
    for line in warnings:
        log(f"Warning: {line}")
    samples = calibration.load(dataset, job_.tokenizer)
    log(f"{adapter.model_type}: {len(moe_layers)} MoE layers × {E} experts → {n_kept} centroids; "
        f"{len(samples)} samples, {engine.total_tokens(samples):,} tokens; similarity {ream.similarity_mode}, "
        f"alignment {ream.alignment}; saliency {ream.saliency_source}")
    warnings += warn_past_context(samples, job_.config, log)
    nbytes, checkpoint = pruned_nbytes(adapter, n_kept), None
    if stream:  # the merged layers are written twice: to the checkpoint, then copied into the output
        checkpoint = stream_checkpoint(job_, "merge", model=model, dataset=dataset, samples=samples,
                                       adapter_path=adapter_path,
                                       calibration=calibration, selection=dataclasses.asdict(selection),
                                       ream=dataclasses.asdict(ream), **_read_hashes(saliency, expert_list))
        nbytes += max(0, nbytes - (dir_size(checkpoint.path) if checkpoint.path.is_dir() else 0))
    job_.res.require_space(nbytes)
    metadata = merge_model(job_.model, adapter, samples, keep_map=None if layerwise and expert_list is None else
                           keep_map, saliency=scores, selection=selection,
                           ream=ream, calibration=calibration, pad_id=pad_id(job_.tokenizer),
                           token_budget=job_.budget, progress=settings.progress, checkpoint=checkpoint, log=log,
                           spill=plan.spill_dir(job_.res) if stream else None)
    metadata.update(n_prune=selection.n_prune, model_wide=selection.model_wide, source=str(saliency or expert_list or "layerwise"),
                    expert_list=None if expert_list is None else str(expert_list), dataset=str(dataset),
                    mlx_fun_version=__version__, **lora.recorded(adapter_path))
    log(f"Saving merged model to {output} ...")
    write_model_dir(job_.res, job_.model, adapter.config, source=model, metadata={"ream_metadata.json": metadata},
                    parts=checkpoint.parts(moe_layers[-1]) if stream else None, donate=stream)
    return MergeResult(Path(output), Path(model), moe_layers, E, n_kept, metadata, time.perf_counter() - start,
                       warnings, stream, peak_rss_bytes())


def _read_hashes(saliency, expert_list) -> dict:
    """The files a merge reads besides the model and the dataset, and their hashes: a streamed merge's identity."""
    from ..observe.checkpoint import file_hash

    return {name: None if path is None else {"path": str(Path(path).resolve()), "sha256": file_hash(path)}
            for name, path in (("saliency", saliency), ("expert_list", expert_list))}


def _check(saliency, expert_list, selection: Selection, settings: RunSettings, ream: Ream) -> None:
    """merge's argument rules between its parameters, one-line ``UserError`` s before anything loads (the rules
    within ``selection``, ``ream`` and ``settings`` held when they were built)."""
    n_prune = selection.n_prune
    if ream.saliency_source == "layerwise":
        if expert_list is None and n_prune is None:
            raise UserError(f"give {param('n_prune')} (how many experts to merge away per layer) or "
                            f"{param('expert_list')} to choose the centroids.")
        if selection.model_wide:
            raise UserError(f"{param('model_wide')} ranks {param('saliency')} up front; the layerwise saliency is "
                            f"measured layer by layer during the merge: pass {param('saliency_source')} file.")
    elif saliency is None and expert_list is None:
        raise UserError(f"give {param('saliency')} (with {param('n_prune')}) or {param('expert_list')} to choose the "
                        f"centroids.")
    if expert_list is None and n_prune is None:
        raise UserError(f"{param('saliency')} needs {param('n_prune')} (how many experts to merge away per layer).")
    if expert_list is not None and n_prune is not None:
        raise UserError(f"{param('expert_list')} already says which experts stay as centroids; drop "
                        f"{param('n_prune')}.")
    if selection.model_wide and expert_list is not None:
        raise UserError(f"{param('model_wide')} selects centroids from {param('saliency')}; it does not apply to "
                        f"{param('expert_list')}.")
    if settings.dequant_bytes():
        raise UserError(f"merge takes no {param('dequant_cache')} (got {settings.dequant_cache!r}): it rewrites the "
                        f"expert weights a dequantized-experts cache would hold; leave it at 0.")


def _centroids(adapter, saliency, expert_list, selection: Selection, model):
    """``(keep_map, scores, warnings)``: the centroids per MoE position, from ``expert_list`` or the ``saliency``
    ranking (``scores``: its checked ranking scores, ``None`` without ``saliency``; neither given: ``n_prune``
    checked on uniform scores, the layerwise merge choosing the centroids); ``model``: the model directory
    (a warning when ``saliency`` was collected on other weights)."""
    import numpy as np

    from ..rewrite.merge import select_centroids
    from ..observe.saliency import SaliencyAccumulator
    from ..experts.selection import check_keep_counts, parse_expert_ranges

    moe_layers, E = adapter.moe_layers(), adapter.num_experts
    scores, warnings = None, []
    if saliency is not None:
        acc = SaliencyAccumulator.load(saliency, name="saliency")
        warnings += acc.check_matches(adapter) + acc.check_provenance(model)
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
            adapter, np.ones((len(moe_layers), E)) if scores is None else scores, selection.n_prune, model_wide=selection.model_wide,
            min_experts_per_layer=selection.min_experts_per_layer,
            ignore_experts=parse_expert_ranges(ignore, E) if ignore else None)
    warnings += check_keep_counts(keep_map, E, adapter.top_k, groups=adapter.groups, moe_layer_indices=moe_layers)
    return keep_map, scores, warnings
