"""The ``collect`` job: calibration data → per-layer × per-expert saliency statistics (.npz)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import param, require_path
from ..observe.saliency import ARRAY_KEYS, SaliencyAccumulator
from ..settings import RunSettings
from .common import Log, check_moe, load_moe, quiet, warn_past_context


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

    @property
    def tokens(self) -> int:
        return self.accumulator.total_tokens


def run(
    *,
    model: str | Path,
    dataset: str | Path,
    output: str | Path,
    max_samples: int = 128,
    max_tokens: int = 2048,
    text_key: str = "content",
    seed: int | None = None,
    batch_size: int = 1,
    pipeline: bool = False,
    force: bool = False,
    settings: RunSettings = RunSettings(),
    log: Log = quiet,
) -> CollectResult:
    """Run ``dataset`` through every MoE layer of ``model`` and write the saliency statistics to ``output``.

    The output is reserved (refused if it is an input, locked, checked writable) before the model is loaded and
    written atomically at the end; an existing ``output`` is replaced only with ``force``. Experts run through mlx-fun's runtime dispatch (``dispatch="auto"``; the
    statistics equal mlx-lm's: counts exactly, norms within float rounding), at most ``settings.token_budget``
    tokens per forward (:mod:`mlx_fun.model.engine`); ``settings``: how to run (:class:`mlx_fun.settings.RunSettings`).

    Under ``mlx.launch`` (:mod:`mlx_fun.observe.distributed`) every rank takes its share of the samples, the float64
    statistics are summed across ranks, and rank 0 alone reserves and writes ``output`` and shows the progress
    bar (all ranks' tokens); every rank returns the summed result.
    """
    import contextlib

    from ..model import engine
    from ..core import writer
    from ..observe.collect import collect
    from ..datasets.samples import load_samples, pad_id
    from ..observe.distributed import check_pipeline, globalize, my_share, reduce_saliency, shared_seed, world

    checked = check_moe(model)  # before anything else: a wrong model is the likeliest mistake
    settings.check()
    require_path("dataset", dataset, "pass a JSONL file or a directory of text files")
    w = world()
    if pipeline:
        check_pipeline(checked[0], w)  # every rank alike, before any collective
    inputs = {param("model"): model, param("dataset"): dataset}
    writer.check_output_path(output, kind="file", inputs=inputs, force=force)  # every rank alike, before collectives
    reserve = (writer.output(output, kind="file", suffix=".npz", inputs=inputs, force=force) if w.writer
               else contextlib.nullcontext())
    say = log if w.writer else quiet  # one rank speaks
    with reserve as res:
        mdl, tokenizer, config, adapter, split = _load(model, w, pipeline, say, checked)
        report = settings.apply(mdl, log=say)
        samples = load_samples(dataset, tokenizer, max_samples=max_samples, max_tokens=max_tokens,
                               text_key=text_key, seed=shared_seed(seed, w))
        mine = samples if pipeline else my_share(samples, w)
        n_layers = len(split[0]) if split else len(adapter.moe_layers())
        ranks = f" over {w.size} ranks" + (" (layers split)" if pipeline else "") if w.size > 1 else ""
        say(f"{adapter.model_type}: {n_layers} MoE layers × {adapter.num_experts} experts, "
            f"top-{adapter.top_k}; {len(samples)} samples, {engine.total_tokens(samples):,} tokens{ranks}")
        warnings = warn_past_context(samples, config, say)
        if w.writer:
            res.require_space(8 * len(ARRAY_KEYS) * n_layers * adapter.num_experts)
        budget = settings.budget(config, dispatch_mode=report.mode, top_k=adapter.top_k)
        start = time.perf_counter()
        acc = collect(mdl, adapter, mine, batch_size=batch_size, pad_id=pad_id(tokenizer), token_budget=budget,
                      progress=settings.progress and w.writer,
                      progress_scale=engine.total_tokens(samples) / max(engine.total_tokens(mine), 1),
                      evaluate_output=pipeline)
        if split:
            acc = globalize(acc, *split)
        acc = reduce_saliency(acc, w, same_tokens=pipeline)
        seconds = time.perf_counter() - start
        if w.writer:
            acc.write_npz(res.tmp)
    return CollectResult(Path(output), acc, len(samples), seconds, report.mode, warnings, w.rank, w.size)


def _load(model, w, pipeline: bool, log: Log, checked: tuple[dict, type]):
    """``(model, tokenizer, config, adapter, split)``: the whole model, or with ``pipeline`` this rank's layers
    and ``split = (the model's MoE layers, this rank's positions among them)``. ``checked``: ``check_moe``'s."""
    if not pipeline:
        return (*load_moe(model, log=log, checked=checked), None)
    from ..observe.distributed import pipeline_load

    log(f"Loading {model} (this rank's layers) ...")
    mdl, tokenizer, config, adapter, global_layers, positions = pipeline_load(model, w)
    return mdl, tokenizer, config, adapter, (global_layers, positions)
