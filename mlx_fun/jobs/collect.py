"""The ``collect`` job: calibration data → per-layer × per-expert saliency statistics (.npz)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from typing import Annotated

from ..core.options import Opt
from ..datasets.calibration import Calibration
from ..model.lora import ADAPTER_PATH
from ..observe.saliency import ARRAY_KEYS, SaliencyAccumulator
from ..settings import RunSettings
from .common import (DATASET, FORCE, MODEL, Loaded, Log, StreamPlan, check_moe, job, model_job, quiet,
                     stream_checkpoint, stream_choice, stream_layers_opt, warn_past_context)


@dataclass
class CollectResult:
    output: Path
    accumulator: SaliencyAccumulator
    samples: int
    seconds: float
    dispatch: str
    warnings: list[str] = field(default_factory=list)
    rank: int = 0  # under mlx.launch: this process's rank (0 wrote the file) and the number of ranks
    ranks: int = 1
    streamed: bool = False  # run one decoder layer at a time (--stream-layers)
    peak_bytes: int = 0  # this process's peak resident memory at the end
    device_peak_bytes: int | None = None  # MLX's peak allocation on a GPU (None on the CPU)
    spilled: bool = False  # streamed with the hidden states carried in files

    @property
    def tokens(self) -> int:
        return self.accumulator.total_tokens


@job
def run(
    *,
    model: Annotated[str | Path, MODEL],
    adapter_path: Annotated[str | Path | None, ADAPTER_PATH] = None,
    dataset: Annotated[str | Path, DATASET],
    output: Annotated[str | Path, Opt("Where to write the saliency statistics (.npz); checked for room and "
                                      "writability before the run.")],
    force: Annotated[bool, FORCE] = False,
    calibration: Calibration = Calibration(),
    settings: RunSettings = RunSettings(),
    pipeline: Annotated[bool, Opt("Under mlx.launch: split the model's layers across the ranks (each loads only "
                                  "its own), for a model no single machine holds; without it the ranks split the "
                                  "samples.")] = False,
    stream_layers: Annotated[bool | None, stream_layers_opt(same="same statistics: counts exactly, sums to float "
                                                       "rounding", resumes=True)] = None,
    log: Log = quiet,
) -> CollectResult:
    """Run ``dataset`` through every MoE layer of ``model`` and write the saliency statistics to ``output``.

    The output is reserved (refused if it is an input, locked, checked writable) before the model is loaded and
    written atomically at the end, with where the statistics came from (the model's name and weights fingerprint, the
    dataset and its samples' hash: :mod:`mlx_fun.observe.provenance`); an existing ``output`` is replaced only with
    ``force``. Experts run through mlx-fun's runtime dispatch (``dispatch="auto"``; the statistics equal mlx-lm's:
    counts exactly, norms within float rounding), at most ``settings.token_budget`` tokens per forward
    (:mod:`mlx_fun.model.engine`); ``settings``: how to run (:class:`mlx_fun.settings.RunSettings`); ``calibration``:
    how the samples are drawn and batched (:class:`mlx_fun.datasets.calibration.Calibration`; its fields may also be
    given by name: ``max_samples=32``).

    ``stream_layers`` (None: when the model's weights exceed :func:`mlx_fun.runtime.memory.available_bytes`): the
    model loads lazily and runs one decoder layer at a time (:func:`mlx_fun.observe.collect.collect_streamed`),
    each layer released after its visit; after every layer a checkpoint is kept in ``.<output name>.stream/``
    beside ``output`` (:mod:`mlx_fun.observe.checkpoint`: it survives a kill or Ctrl-C), which rerunning the same
    command resumes from, and which is removed once ``output`` is written. The samples' hidden states spill to files
    beside ``output`` when they do not fit beside one layer (:func:`mlx_fun.jobs.common.stream_choice`). Not with
    ``pipeline``.

    Under ``mlx.launch`` (:mod:`mlx_fun.observe.distributed`) every rank takes its share of the samples, the float64
    statistics are summed across ranks, and rank 0 alone reserves and writes ``output`` and shows the progress
    bar (all ranks' tokens); every rank returns the summed result.

    ``adapter_path``: a LoRA adapter fused into the model as it loads (:mod:`mlx_fun.model.lora`): the statistics
    are the fine-tuned model's, and the file records the adapter. Not with ``pipeline`` (each rank loads a slice of
    the layers, which mlx-lm's adapters do not address; mlx-lm's distributed server refuses adapters too).
    """
    from ..core import writer
    from ..observe.distributed import check_pipeline, world

    checked = check_moe(model)  # before anything else: a wrong model is the likeliest mistake
    w = world()
    say = log if w.writer else quiet  # one rank speaks
    plan = _stream_choice(model, stream_layers, pipeline, w, checked, say,
                          tokens=calibration.max_samples * calibration.max_tokens)
    if pipeline and adapter_path is not None:
        from ..errors import UserError, param

        raise UserError(f"{param('adapter_path')} does not work with {param('pipeline')}: each rank loads a slice of "
                        f"the layers; fuse the adapter first (mlx_lm.fuse) and collect the fused model.")
    if pipeline:
        check_pipeline(checked[0], w)  # every rank alike, before any collective
    writer.check_output_path(output, kind="file", force=force)  # every rank alike, before any collective
    split = []  # with pipeline: the model's MoE layers and this rank's positions among them

    def pipeline_load():
        from ..observe.distributed import pipeline_load

        say(f"Loading {model} (this rank's layers) ...")
        mdl, tokenizer, config, adapter, global_layers, positions = pipeline_load(model, w)
        split.extend((global_layers, positions))
        return mdl, tokenizer, config, adapter

    with model_job(model, output=output if w.writer else None, suffix=".npz", force=force, settings=settings,
                   log=say, checked=checked, load=pipeline_load if pipeline else None, lazy=plan.layers,
                   adapter_path=adapter_path, checkpointed=plan.layers) as job_:
        result = _collect(job_, model, dataset, output, calibration, settings, w, tuple(split) or None, say, plan,
                          adapter_path)
    return result


def _stream_choice(model, stream_layers: bool | None, pipeline: bool, w, checked: tuple[dict, type], say: Log, *,
                   tokens: int) -> StreamPlan:
    """Whether to stream the layers, and spill (:func:`mlx_fun.jobs.common.stream_choice`); refused with
    ``pipeline``, and under mlx.launch when asked."""
    from ..errors import UserError, param

    if stream_layers and pipeline:
        raise UserError(f"{param('stream_layers')} and {param('pipeline')} are two ways to run a model larger than "
                        f"memory; pass one of them.")
    if stream_layers and w.size > 1:
        raise UserError(f"{param('stream_layers')} runs in one process; under mlx.launch pass {param('pipeline')} "
                        f"to split the model's layers across the ranks.")
    if pipeline or w.size > 1:
        return StreamPlan(False)
    return stream_choice(stream_layers, [(model, checked[1], checked[0])], doing="collecting", log=say, tokens=tokens)


def _collect(job_: Loaded, model, dataset, output, calibration: Calibration, settings: RunSettings, w, split, log: Log,
             plan: StreamPlan = StreamPlan(False), adapter_path=None):
    """The calibration pass of :func:`run` on a loaded model (``split``: with ``pipeline``, the model's MoE layers
    and this rank's positions among them); rank 0 writes ``job_.res`` (with the adapter's record)."""
    from ..datasets.samples import pad_id
    from ..model import engine, lora
    from ..observe.collect import collect, collect_streamed
    from ..observe.distributed import globalize, my_share, reduce_saliency, shared_seed

    say = log
    pipeline = split is not None
    adapter = job_.adapter
    samples = calibration.load(dataset, job_.tokenizer, seed=shared_seed(calibration.seed, w))
    mine = samples if pipeline else my_share(samples, w)
    n_layers = len(split[0]) if split else len(adapter.moe_layers())
    ranks = f" over {w.size} ranks" + (" (layers split)" if pipeline else "") if w.size > 1 else ""
    say(f"{adapter.model_type}: {n_layers} MoE layers × {adapter.num_experts} experts, "
        f"top-{adapter.top_k}; {len(samples)} samples, {engine.total_tokens(samples):,} tokens{ranks}")
    warnings = warn_past_context(samples, job_.config, say)
    if w.writer:
        job_.res.require_space(8 * len(ARRAY_KEYS) * n_layers * adapter.num_experts)
    start = time.perf_counter()
    if plan.layers:
        acc = collect_streamed(job_.model, adapter, mine, batch_size=calibration.batch_size,
                               pad_id=pad_id(job_.tokenizer), token_budget=job_.budget,
                               progress=settings.progress and w.writer, log=say, spill=plan.spill_dir(job_.res),
                               checkpoint=stream_checkpoint(job_, "collect", model=model, dataset=dataset,
                                                            samples=samples, calibration=calibration,
                                                            adapter_path=adapter_path)
                               if w.size == 1 else None)
    else:
        acc = collect(job_.model, adapter, mine, batch_size=calibration.batch_size, pad_id=pad_id(job_.tokenizer),
                      token_budget=job_.budget, progress=settings.progress and w.writer,
                      progress_scale=engine.total_tokens(samples) / max(engine.total_tokens(mine), 1),
                      evaluate_output=pipeline)
    if split:
        acc = globalize(acc, *split)
    acc = reduce_saliency(acc, w, same_tokens=pipeline)
    seconds = time.perf_counter() - start
    acc.adapter = lora.describe(adapter_path)
    if w.writer:
        from ..observe.checkpoint import samples_hash
        from ..observe.provenance import collected_on

        # which model and data: prune, merge and quantize compare the model's fingerprint with theirs
        acc.provenance = collected_on(model, dataset, samples_hash(samples))
        acc.write_npz(job_.res.tmp)
    from ..runtime.memory import device_peak_bytes, peak_rss_bytes

    return CollectResult(Path(output), acc, len(samples), seconds, job_.dispatch.mode, warnings, w.rank, w.size,
                         plan.layers, peak_rss_bytes(), device_peak_bytes(), plan.spill)
