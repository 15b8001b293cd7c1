"""What the jobs share: what a job reads (from its signature: every output it reserves is checked against it),
checking inputs before loading, loading a supported MoE model, status lines."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Sequence

import click

from ..core.options import Opt, check_path, check_value, job_opts
from ..core.ranges import FiniteFloat
from ..core.writer import reading
from ..datasets.calibration import Calibration
from ..datasets.samples import MAX_SAMPLE_BYTES
from ..errors import param
from ..settings import RunSettings, checking_groups, grouped, option_groups

Log = Callable[[str], None]


def quiet(_line: str) -> None:
    """The default ``log`` of a job called from Python: status lines and warnings are dropped."""


def check_moe(model_path) -> tuple[dict, type]:
    """Fail fast (before loading weights) on a missing model, a malformed config (``io.read_config`` checks it), an
    unsupported ``model_type`` or a directory without tokenizer files; return the config and the adapter class
    (hand both to :func:`load_moe`, so nothing is read, checked or resolved twice)."""
    from ..adapters import adapter_class
    from ..model.io import check_tokenizer, read_config

    config = read_config(model_path)
    cls = adapter_class(config)
    check_tokenizer(model_path)
    return config, cls


def check_supported(model_path) -> dict:
    """:func:`check_moe`'s checks; return the config."""
    return check_moe(model_path)[0]


def load_moe(model_path, *, lazy: bool = False, log: Log = quiet, checked: tuple[dict, type] | None = None,
             tokenizer: bool = True, adapter_path=None):
    """``(model, tokenizer, config, adapter)`` of a supported MoE model directory (``tokenizer=False``: None in
    its place, for jobs that only rewrite weights: :func:`mlx_fun.model.io.load_model`), with the LoRA adapter at
    ``adapter_path`` fused into its weights (:mod:`mlx_fun.model.lora`).

    Every job checks its model first (:func:`check_supported` / :func:`check_moe`, before it reserves its output),
    so nothing is checked again here: ``checked`` (what :func:`check_moe` returned) skips re-reading the config
    and re-resolving the adapter class; without it the loader reads the config again and ``get_adapter`` still
    refuses an unsupported ``model_type``."""
    from ..adapters import get_adapter
    from ..model import lora
    from ..model.io import load_model

    log(f"Loading {model_path}" + (f" with the adapter {adapter_path} fused" if adapter_path is not None else "")
        + " ...")
    if checked is None:
        model, tok, config = load_model(model_path, lazy=lazy, tokenizer=tokenizer, adapter_path=adapter_path)
        cls = None
    else:
        config, cls = checked
        model, tok, config = load_model(model_path, lazy=lazy, config=config, tokenizer=tokenizer,
                                        adapter_path=adapter_path)
    if (line := lora.note(model)) is not None:
        log(f"Note: {line}")
    return model, tok, config, get_adapter(model, config) if cls is None else cls(model, config)


def warn_past_context(samples: Sequence[Sequence[int]], config: dict, log: Log, name: str = "max_tokens") -> list[str]:
    """A warning when samples are longer than the model's context (their tail is extrapolation)."""
    from ..model.io import context_length

    limit = context_length(config)
    longer = sum(len(s) > limit for s in samples) if limit else 0
    if not longer:
        return []
    line = (f"{longer} sample(s) are longer than the model's context of {limit:,} tokens (max_position_embeddings); "
            f"positions past it were never trained. Lower {param(name)} to {limit}.")
    log(f"Warning: {line}")
    return [line]


def stream_layers_opt(*, same: str = "the same results: counts exactly, sums to float rounding",
                      resumes: bool | str = False, visits: str = "for its one visit", spills: bool = True) -> Opt:
    """``--stream-layers/--no-stream-layers`` (a tri-state: None, neither given, is :func:`stream_choice`'s
    automatic choice); ``same``: what the streamed run gives alike, ``resumes``: a killed run resumes (at the next
    layer, or where the text says), ``visits``: when a layer's weights are read (a job that runs the model more than
    once reads them again), ``spills``: the carried hidden states go to files when they do not fit."""
    where = "at the next layer" if resumes is True else resumes
    resume = f"a killed run resumes {where} when rerun. " if resumes else ""
    spill = (" Streamed, the samples' hidden states are kept in files on disk (beside the output) when they do not "
             "fit in memory beside one layer." if spills else "")
    return Opt(f"Run the model one decoder layer at a time, each layer's weights read from its files {visits} "
               f"and then released, for a model larger than memory ({same}); {resume}Default: stream when the "
               f"model's weights exceed the memory this process can use.{spill}",
               flag="--stream-layers/--no-stream-layers")


STREAM_LAYERS = stream_layers_opt()


#: the options of a differential scan (``safety-scan`` / ``domain-scan``) besides its two datasets
SCAN_OUTPUT = Opt("The report to write (JSON).", type=click.Path(dir_okay=False))
PERCENTILE = Opt("Percentile over all layers' experts above which (and below 100 minus which) experts are "
                 "classified: of the risk difference (safety-scan), of the composite score (domain-scan).",
                 type=FiniteFloat(50, 100, min_open=True, max_open=True))


def differential_job(kind: str, *, model, dataset_a: tuple[str, object], dataset_b: tuple[str, object], output,
                     calibration: Calibration, threshold_percentile: float, settings: RunSettings, log: Log,
                     extra: dict | None = None, force: bool = False, stream_layers: bool | None = None,
                     adapter_path=None) -> dict:
    """The shared body of ``safety-scan`` / ``domain-scan``: two datasets through the hooked model, one report.

    ``dataset_a`` / ``dataset_b`` are (parameter name, path): harmful / benign or domain / general, each read under
    ``calibration`` (chats with their generation prompt). The job's ``@job`` wrapper has checked that both exist.
    ``stream_layers`` (None: :func:`stream_choice`): the model loads lazily and both datasets run together through
    one streamed forward, each layer's weights read once (:func:`mlx_fun.observe.differential.scan_streamed`),
    resumable: its checkpoint in ``.<output name>.stream/`` beside ``output``, removed once the report is written.
    ``adapter_path``: a LoRA adapter fused into the model (:mod:`mlx_fun.model.lora`), recorded in the report.
    """
    from ..datasets.samples import pad_id
    from ..model import lora
    from ..observe.differential import report, scan, scan_streamed

    check_value("threshold_percentile", threshold_percentile, PERCENTILE)
    checked = check_moe(model)
    plan = stream_choice(stream_layers, [(model, checked[1], checked[0])], doing="scanning", log=log,
                         tokens=2 * calibration.max_samples * calibration.max_tokens)
    with model_job(model, output=output, kind="file", force=force, settings=settings, log=log, checked=checked,
                   lazy=plan.layers, adapter_path=adapter_path, checkpointed=plan.layers) as job_:
        names = [name.replace("_dataset", "") for name, _path in (dataset_a, dataset_b)]
        paths = [path for _name, path in (dataset_a, dataset_b)]
        sets = [calibration.load(path, job_.tokenizer, generation_prompt=True) for path in paths]
        how = dict(batch_size=calibration.batch_size, pad_id=pad_id(job_.tokenizer), token_budget=job_.budget,
                   progress=settings.progress)
        if plan.layers:
            from ..observe.checkpoint import samples_hash

            checkpoint = stream_checkpoint(job_, f"{kind}-scan", model=model, dataset=paths[0], samples=sets[0],
                                           adapter_path=adapter_path,
                                           calibration=calibration, dataset_b=str(Path(paths[1]).resolve()),
                                           samples_b_sha256=samples_hash(sets[1]))
            taps = scan_streamed(job_.model, job_.adapter, sets, desc=f"{kind}-scan", refusal=f"a streamed {kind}-scan",
                                 spill=plan.spill_dir(job_.res), checkpoint=checkpoint, log=log, **how)
        else:
            taps = [scan(job_.model, job_.adapter, samples, desc=name, **how) for name, samples in zip(names, sets)]
        datasets = {name: {"path": str(path), "samples": len(samples), "tokens": tap.tokens}
                    for name, path, samples, tap in zip(names, paths, sets, taps)}
        out = report(kind, taps[0], taps[1], job_.adapter, percentile=float(threshold_percentile),
                     datasets=datasets, extra={"model": str(model), **lora.recorded(adapter_path), **(extra or {})})
        job_.res.write_json(out)
    return out


# ------------------------------------------------------------------------------ what a job reads
#: job parameters that name what a job writes (or a directory it writes into), not what it reads
OUTPUT_PARAMS = frozenset({"output", "auto_save", "data_dir", "merge_into"})


def _names_a_path(annotation) -> bool:
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    return "Path" in str(annotation)


def path_params(func: Callable) -> list[str]:
    """The parameters of ``func`` that name files or directories it reads: every one annotated with ``Path``
    (``str | Path``, ``str | Path | None``, ``Sequence[str | Path]``) except :data:`OUTPUT_PARAMS`, and every such
    field of an option group (:func:`mlx_fun.settings.option_groups`), as ``group.field``
    (``settings.dispatch_table``)."""
    groups = option_groups(func)
    hints = typing.get_type_hints(inspect.unwrap(func), include_extras=True)
    names = []
    for name, p in inspect.signature(func).parameters.items():
        if name in groups:
            names += [f"{name}.{f.name}" for f in dataclasses.fields(groups[name])
                      if "Path" in str(f.type) and f.name not in OUTPUT_PARAMS]
        elif _names_a_path(hints.get(name, p.annotation)) and name not in OUTPUT_PARAMS:
            names.append(name)
    return names


def _read_path(bound: inspect.BoundArguments, name: str):
    """The value of parameter ``name`` (``group.field``: that field of the group given or defaulted)."""
    group, _, field = name.partition(".")
    value = bound.arguments.get(group, bound.signature.parameters[group].default)
    return getattr(value, field, None) if field else value


def job_inputs(run: Callable) -> Callable:
    """Wrap a job's ``run`` so that, while it runs, every output it reserves is checked against every path it
    was given to read (:func:`path_params`; messages name a group's field by its own name): ``mlx_fun.jobs``
    wraps each job once, in one list."""
    names = path_params(run)
    signature = inspect.signature(run)

    @functools.wraps(run)
    def wrapped(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        paths = {param(n.rpartition(".")[2]): v for n in names if (v := _read_path(bound, n)) is not None}
        with reading(paths):
            return run(*args, **kwargs)

    wrapped.reads = tuple(names)
    return wrapped


# ------------------------------------------------------------------------------ the job skeleton
#: the options every model job shares (``Annotated[..., MODEL]``): declared once, generated into each command
MODEL = Opt("An mlx-lm model: a local directory (config.json + safetensors + tokenizer), or a Hugging Face repo id "
            "(org/name) fetched into the Hugging Face cache as mlx-lm does (only the files mlx-lm needs; "
            "HF_HUB_OFFLINE=1: from the cache alone). A local directory of that name wins over the repo.")
DATASET = Opt("JSONL file (messages / prompt+completion / text lines, detected per line) or a directory of files; "
              f"UTF-8, each line (or file) at most {MAX_SAMPLE_BYTES >> 20} MiB, no devices or FIFOs.",
              missing="pass a JSONL file or a directory of text files")


def force(what: str = "an existing --output file") -> Opt:
    """``--force``: the one way to let a command replace what exists (the writer refuses it otherwise)."""
    return Opt(f"Replace {what}; refused otherwise (inputs, links and devices never are).")


FORCE = force()
FORCE_DIR = force("a non-empty --output directory")


#: what a streamed run needs besides one layer's weights and the carried hidden states, counted when it decides
#: whether they spill: what it loads after the choice (the tokenizer, the runtime's buffers) and one batch's
#: activations (a token budget's worth); the choice is made before loading, when this much is not yet in use
STREAM_HEADROOM = 1 << 30


@dataclass(frozen=True)
class StreamPlan:
    """What :func:`stream_choice` decided: ``layers``, run the models one decoder layer at a time; ``spill``, carry
    the samples' hidden states in files rather than in memory (``spill`` of the streamed runs)."""

    layers: bool
    spill: bool = False

    def spill_dir(self, res) -> Path | None:
        """Where to spill (None: not spilling): ``<temp>.spill`` beside the output's temporary file (``res``, its
        reservation: the writer's temp naming, so what a killed run leaves is removed by the next run writing the
        same output), else a new temporary directory (``TMPDIR``)."""
        if not self.spill:
            return None
        if res is not None:
            return Path(f"{res.tmp}.spill")
        import tempfile

        return Path(tempfile.mkdtemp(prefix="mlx-fun-spill-"))


def stream_choice(stream_layers: bool | None, models: Sequence[tuple[Any, type | None, dict]], *, doing: str,
                  log: Log, tokens: int, adapter_path=None) -> StreamPlan:
    """Whether a job streams its ``models`` (``(directory, adapter class or None, its checked config)`` each: the
    model, then a reference) one decoder layer at a time: as asked (refused in one line for a model without an
    adapter: a dense one), else when their weights together exceed the memory left, with a one-line note
    (``doing``: what the job does instead, "collecting"); a model without an adapter, or whose family cannot run
    one layer at a time, is then run in memory (a note says so).

    Streamed, whether the hidden states spill to files: when one decoder layer of each model (its largest), the
    hidden states every model carries (``tokens``, the most the job's samples can hold: samples × max tokens of
    every sample set, × the hidden size × the model's dtype) and :data:`STREAM_HEADROOM` exceed the memory left;
    the note says so.

    ``adapter_path``: given by a job whose streamed run reads its layers again from the model's files (abliterate),
    where a LoRA adapter fused as the model loaded would be lost: streaming with one is refused in one line (fuse it
    first). The single-pass streamed jobs stream the fused layers as loaded and take no ``adapter_path`` here."""
    from ..errors import UserError
    from ..runtime.memory import available_bytes, weight_bytes

    dense = [(path, flag) for (path, cls, _), flag in zip(models, ("model", "reference")) if cls is None]
    if stream_layers and dense:
        path, flag = dense[0]
        raise UserError(f"{param('stream_layers')} runs the decoder layers of a supported Mixture-of-Experts "
                        f"family, and {param(flag)} {path} is not one (a dense model?); run it without "
                        f"{param('stream_layers')}.")
    if stream_layers is False:
        return StreamPlan(False)
    from ..core.sizes import format_bytes

    room = available_bytes()
    if stream_layers is None:
        need = sum(weight_bytes(path) for path, _, _ in models)
        if room is None or need <= room:
            return StreamPlan(False)
        over = f"Note: the weights ({format_bytes(need)}) exceed the memory left ({format_bytes(room)})"
        for path, cls, config in models:
            reason = None if cls is None else cls.config_layerwise_blocker(config)
            if cls is None or reason:
                what = (f"{path} is not of a supported Mixture-of-Experts family" if cls is None else
                        f"{cls.model_types[0]} cannot run one layer at a time ({reason})")
                log(f"{over}, but {what}: {doing} in memory.")
                return StreamPlan(False)
    if adapter_path is not None:
        why = (f"{param('stream_layers')} reads each layer from the model's files" if stream_layers else
               f"the weights ({format_bytes(need)}) exceed the memory left ({format_bytes(room)}), so it would run "
               f"one layer at a time from the model's files")
        raise UserError(f"{param('adapter_path')} is fused into the weights as they load, and {why}; fuse the "
                        f"adapter first (python -m mlx_lm fuse --model MODEL --adapter-path {adapter_path} "
                        f"--save-path FUSED) and pass the fused model.")
    sizes = [_streamed_bytes(path, cls, config, tokens) for path, cls, config in models]
    layer, hidden = sum(size[0] for size in sizes), sum(size[1] for size in sizes)
    spill = room is not None and layer + hidden + STREAM_HEADROOM > room
    spilled = (f"the samples' hidden states (up to {format_bytes(hidden)}) do not fit beside one layer "
               f"({format_bytes(layer)}) and {format_bytes(STREAM_HEADROOM)} for the run itself")
    if stream_layers is None:
        off = "--no-stream-layers" if param("x").startswith("--") else "stream_layers=False"
        log(f"{over}: streaming the layers (one decoder layer's weights in memory at a time; {off} loads them all)"
            + (f"; {spilled}: spilling them to files on disk." if spill else "."))
    elif spill:
        log(f"Note: {spilled} in the memory left ({format_bytes(room)}): spilling them to files on disk.")
    return StreamPlan(True, spill)


def _streamed_bytes(model_dir, cls: type, config: dict, tokens: int) -> tuple[int, int]:
    """``(largest decoder layer, hidden states of tokens)`` in bytes, from the safetensors headers: a layer is the
    tensors named ``…layers.<n>.…``, the hidden states take the floating dtype that holds most of the weights (a
    quantized model's scales: the dtype it computes in)."""
    import re

    from ..output.streaming import source_tensors

    layers: dict[str, int] = {}
    floats: dict[str, int] = {}
    for name, t in source_tensors(model_dir).items():
        if (m := re.match(r"(.*?\blayers\.\d+)\.", name)) is not None:
            layers[m.group(1)] = layers.get(m.group(1), 0) + t.nbytes
        if t.dtype in _FLOAT_BYTES:
            floats[t.dtype] = floats.get(t.dtype, 0) + t.nbytes
    itemsize = _FLOAT_BYTES[max(floats, key=floats.get)] if floats else 2
    return max(layers.values(), default=0), tokens * cls.config_hidden_size(config) * itemsize


_FLOAT_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}


def stream_checkpoint(job_: "Loaded", job: str, *, model, dataset, samples: Sequence[Sequence[int]],
                      calibration: Calibration, adapter_path=None, **options):
    """A streamed ``job``'s checkpoint beside its output (:class:`mlx_fun.observe.checkpoint.StreamCheckpoint`),
    named by what the run reads (the model and its config's hash, the dataset and its samples' hash), how it
    batches, the job's own ``options`` (JSON-able values; a file's hash where a run reads one), the LoRA adapter fused
    into the model (its weights' hash) and the output; removed once the output is written where the job's
    :func:`model_job` is ``checkpointed``."""
    import dataclasses
    from pathlib import Path

    from ..observe.checkpoint import StreamCheckpoint, checkpoint_dir, file_hash, samples_hash

    model_dir = Path(model)
    identity = {"job": job, "model": str(model_dir.resolve()), "config_sha256": file_hash(model_dir / "config.json"),
                "dataset": str(Path(dataset).resolve()), "samples_sha256": samples_hash(samples),
                "calibration": dataclasses.asdict(calibration), "token_budget": job_.budget,
                "dispatch": None if job_.dispatch is None else job_.dispatch.mode, "output": str(job_.res.path),
                **options}
    if adapter_path is not None:  # a checkpoint of the base model (or of another adapter) is not resumed
        identity["adapter_sha256"] = file_hash(Path(adapter_path) / "adapters.safetensors")
    return StreamCheckpoint(checkpoint_dir(job_.res.path), identity, job=job)


def folding(run: Callable) -> Callable:
    """Wrap ``run`` so a Python caller may also give an option group's fields by name (``max_samples=32`` for
    ``calibration=Calibration(max_samples=32)``): they are folded into the group (:func:`mlx_fun.settings.grouped`)."""
    @functools.wraps(run)
    def wrapped(*args, **kwargs):
        return run(*args, **grouped(run, kwargs))

    return wrapped


def checking_options(run: Callable) -> Callable:
    """Wrap ``run`` so each option given to it is checked against its declaration before the body runs: a value
    against its range or choices (:func:`mlx_fun.core.options.check_value`; a group checked itself when built), and
    every path it reads that must exist (``Opt(missing=...)``, on a parameter or a group field) does. One line
    naming the option and the fix."""
    opts = {name: opt for name, (opt, _default) in job_opts(run).items()}
    groups = option_groups(run)
    defaults = {name: p.default for name, p in inspect.signature(run).parameters.items()}

    @functools.wraps(run)
    def wrapped(*args, **kwargs):
        for name, opt in opts.items():
            if name in kwargs:
                check_value(name, kwargs[name], opt)
                check_path(name, kwargs[name], opt)
        for name, cls in groups.items():
            value = kwargs.get(name, defaults[name])
            if isinstance(value, cls) and hasattr(value, "check_paths"):
                value.check_paths()
        return run(*args, **kwargs)

    return wrapped


def job(run: Callable | None = None, *, any_model: bool = False):
    """The wrappers of every job's ``run``, applied where the job is defined (``@job`` above ``def run``), in the
    order they act: a Hugging Face repo id in ``model`` (``reference``, ``draft_model``) resolved first, with
    ``revision=`` (:func:`mlx_fun.model.hub.resolving`; ``any_model``: a dense model too); group fields given by
    name folded into their group (:func:`folding`); every output the job reserves refused if it is, holds or lies in
    a path the job reads (:func:`job_inputs`, the one input guard, from the signature); each group an instance of
    its dataclass (:func:`mlx_fun.settings.checking_groups`); each option within its declared range, and each path
    it reads that must exist there (:func:`checking_options`)."""
    from ..model.hub import resolving

    def wrap(run: Callable) -> Callable:
        wrapped = resolving(folding(job_inputs(checking_groups(checking_options(run)))), needs_moe=not any_model)
        wrapped.any_model = any_model
        return wrapped

    return wrap if run is None else wrap(run)


@dataclass
class Loaded:
    """What :func:`model_job` yields: the output's reservation (``res``; None without an output), the model, its
    tokenizer, config and adapter, the dispatch report, and the engine's token budget per forward."""

    res: Any
    model: Any
    tokenizer: Any
    config: dict
    adapter: Any
    dispatch: Any = None
    budget: int | None = None


@contextlib.contextmanager
def model_job(model, *, output=None, kind: str = "file", suffix: str | None = None, force: bool = False,
              settings: RunSettings | None = None, log: Log = quiet, checked: tuple[dict, type] | None = None,
              before_load: Callable[[], None] | None = None, lazy: bool = False, tokenizer: bool = True,
              load: Callable[[], tuple] | None = None, adapter_path=None, checkpointed: bool = False):
    """The steps every model job takes, in order: check the model (:func:`check_moe`: config, family, tokenizer
    files; without weights; ``checked``: already done) and the LoRA adapter at ``adapter_path``
    (:func:`mlx_fun.model.lora.check`), ``before_load`` (the job's own checks), reserve ``output``
    (:func:`mlx_fun.core.writer.output`; refused if it is an input, locked or unwritable, an existing one replaced
    only with ``force``), load the model (the adapter fused into it), install the dispatch (``settings.apply``) and
    work out the token budget. Yields :class:`Loaded`; the output is committed when the block ends without error.
    ``load``: the job's own loader (``(model, tokenizer, config, adapter)``: one rank's layers under
    ``--pipeline``; it fuses the adapter itself). ``checkpointed``: a layer-streamed run, whose checkpoint beside
    the output (:func:`stream_checkpoint`) is removed once the output is committed (it has served; a failed or
    interrupted run leaves it to resume from)."""
    from ..core import writer
    from ..model import lora

    checked = checked or check_moe(model)
    if adapter_path is not None:
        lora.check(adapter_path)
    if before_load is not None:
        before_load()
    reserve = (writer.output(output, kind=kind, suffix=suffix or "", force=force) if output is not None
               else contextlib.nullcontext())
    with reserve as res:
        mdl, tok, config, adapter = (load() if load is not None else
                                     load_moe(model, log=log, checked=checked, lazy=lazy, tokenizer=tokenizer,
                                              adapter_path=adapter_path))
        loaded = Loaded(res, mdl, tok, config, adapter)
        if settings is not None:
            loaded.dispatch = settings.apply(mdl, log=log)
            loaded.budget = settings.budget(config, dispatch_mode=loaded.dispatch.mode, top_k=adapter.top_k)
        yield loaded
    if checkpointed and res is not None:  # committed: the checkpoint has served
        import shutil

        from ..observe.checkpoint import checkpoint_dir

        shutil.rmtree(checkpoint_dir(res.path), ignore_errors=True)
