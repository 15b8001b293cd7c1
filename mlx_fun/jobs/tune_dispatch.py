"""The ``tune-dispatch`` job: measure the MoE dispatch cut-offs of expert shapes on this backend, write a table."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Sequence

import click

from ..core.options import Opt
from ..dispatch.tune_options import Measurement, int_list
from ..errors import UserError, param
from .common import Log, job, quiet
from .common import force as force_opt


@dataclass
class TuneResult:
    entries: list  # mlx_fun.dispatch.table.Entry, one per measured expert shape
    written: list[str] = field(default_factory=list)
    user_table: bool = True  # written to the user table that --dispatch auto reads
    busy: str | None = None  # how busy the machine was, when other processes used too much of it (the warning)
    held: list[str] = field(default_factory=list)  # default tables not written because the machine was busy


@job(any_model=True)
def run(
    *,
    model: Annotated[str | Path | None, Opt(
        "An mlx-lm model (a local directory, or a Hugging Face repo id as in --model of the other commands): tune "
        "each distinct expert shape/quantization it has.", type=click.Path())] = None,
    shape: Annotated[Sequence[str], Opt(
        "Instead of --model: a synthetic layer with these hidden, expert, expert-count and top-k sizes (repeatable), "
        "e.g. 2048,768,128,8 (Qwen3-30B-A3B).", metavar="D,H,E,K", multiple=True)] = (),
    quant: Annotated[Sequence[str], Opt(
        "With --shape (repeatable): float32, bfloat16, float16, affine4[-g64], affine8, mxfp4, nvfp4, mxfp8. "
        "Default: the float dtype of this backend (float32 on CPU, bfloat16 on a GPU) and affine4-g64.",
        multiple=True)] = (),
    dtype: Annotated[str | None, Opt(
        "With --shape: activation (and scale) dtype of quantized layers (default float32 on CPU, bfloat16 on a GPU).",
        type=click.Choice(["float32", "bfloat16", "float16"]))] = None,
    gpt_oss: Annotated[bool, Opt("With --shape: gpt-oss experts (biases, clamped SwiGLU).")] = False,
    top_k: Annotated[int | None, Opt("With --model: override the top-k from config.json.",
                                     type=click.IntRange(min=1))] = None,
    measure: Measurement = Measurement(),
    output: Annotated[str | Path | None, Opt(
        "Table file to write; an existing one only with --force, which merges the entries into it (same key: "
        "replaced). Default: the user table that the model commands (collect, eval, smoke-test, serve, ...) read with "
        "--dispatch auto, merged into ($MLX_FUN_DISPATCH_TABLE or "
        "~/.cache/mlx-fun/dispatch_table.json).", type=click.Path(dir_okay=False))] = None,
    force: Annotated[bool, force_opt("an existing --output table, keeping its other entries (and install a table "
                                     "measured on a busy machine as the default all the same)")] = False,
    merge_into: Annotated[str | Path | None, Opt(
        "Also merge the new entries into this table (e.g. mlx_fun/dispatch/dispatch_table.json of a checkout).",
        type=click.Path(dir_okay=False))] = None,
    progress: bool = False,
    log: Log = quiet,
    on_entry=None,
) -> TuneResult:
    """Measure every dispatch plan for each distinct expert shape of ``model`` (or each ``shape`` D,H,E,k with
    ``quant``) for token counts ``measure.ms`` and write the cut-offs: merged into ``output`` (an existing file
    only with ``force``), default the user table (the cache ``--dispatch auto`` reads: merged into as it is);
    also into ``merge_into`` (merging into it is what it asks). The tables are reserved (checked, locked, proven
    writable) before anything is measured. ``on_entry(entry)`` is called as each shape is done.

    A busy machine (other processes using more than a quarter of its cores, at least half a core, just before or
    while measuring: :mod:`mlx_fun.runtime.cpu_load`) gives noisy timings: a warning says so, and without ``force``
    the user table, which every later run would read, is left as it was: the entries go to :func:`busy_table_path`
    instead (``--dispatch-table`` can name it). Files named by ``output`` and ``merge_into`` are written as asked.

    ``measure`` (:class:`mlx_fun.dispatch.tune_options.Measurement`): token counts, largest M, block sizes, whether to
    try dequantized plans, the margin a plan must win by and the minimum repeats."""
    from ..dispatch import experts as dsp
    from ..runtime import cpu_load

    started = cpu_load.started()  # the busy check's window opened when the command started: its start counts
    if bool(model) == bool(shape):
        raise UserError(f"pass either {param('model')} or {param('shape')} (not both).")
    ms_list, block_list = measure.token_counts(), measure.block_sizes()
    backend = dsp.backend_name()

    if model:
        targets = _specs_from_model(model, top_k, backend)
    else:
        targets = _specs_from_shapes(shape, quant, dtype, gpt_oss, backend)

    out_path = Path(output) if output else dsp.user_table_path()
    tables = {out_path: (param("output") if output else "the user dispatch table", force or not output)}
    if merge_into:
        tables.setdefault(Path(merge_into), (param("merge_into"), True))
    return _tune_into(tables, output=output, force=force, log=log, started=started, measure=lambda: _measure_all(
        targets, ms_list, block_list, backend, measure, progress, log, on_entry))


def _tune_into(tables: dict, *, output, force: bool, log: Log, measure, started=None) -> TuneResult:
    """Reserve ``tables`` (path → (flag, merge into it)), run ``measure()`` (the entries) while watching the load,
    and merge the entries into each table (``started``: a :class:`cpu_load.Watch` opened when the command started, so
    the load before measuring is read over the start-up rather than over a sleep of its own); on a busy machine, without ``force``, the user table (the first table
    without ``output``) is left as it was and the entries go to :func:`busy_table_path`."""
    import contextlib

    from ..core import writer
    from ..dispatch import experts as dsp
    from ..runtime import cpu_load

    default = None if output else next(iter(tables))  # the user table: what every later --dispatch auto reads
    with contextlib.ExitStack() as stack:
        reserved = [(path, stack.enter_context(writer.output(path, kind="file", flag=flag, force=merge)))
                    for path, (flag, merge) in tables.items()]
        old = {path: _read_table(path) for path in tables}  # under the locks: what the new entries merge into
        before = cpu_load.sample(since=started)
        if before.busy:
            log(f"Warning: this machine is busy ({before.describe()}): the timings will be noisy"
                + ("" if force or default is None else f"; they will not become the default ({param('force')} "
                   f"installs them)") + ".")
        watch = cpu_load.Watch()
        entries = measure()
        load = before if before.busy else watch.load()
        held = [default] if default is not None and load.busy and not force else []
        new = dsp.Table(entries)
        for path, res in reserved:
            if path in held:
                res.discard()  # a noisy table does not become a default: the file stays as it was
            else:
                res.write_text(dsp.table_text(old[path].merged(new)))
    result = TuneResult(entries, [str(p) for p in tables if p not in held], user_table=not output and not held,
                        held=[str(p) for p in held], busy=load.describe() if load.busy else None)
    if held:
        side = busy_table_path()
        writer.write_text(side, dsp.table_text(new), force=True, flag="the busy-machine table")
        result.written.append(str(side))
    if load.busy:
        log(_busy_line(result, force))
    return result


def busy_table_path() -> Path:
    """Where a table measured on a busy machine goes instead of the user table (beside it, replaced each time)."""
    from ..dispatch.table import user_table_path

    user = user_table_path()
    return user.with_name(f"{user.stem}.busy{user.suffix or '.json'}")


def _busy_line(result: TuneResult, force: bool) -> str:
    """The warning after measuring on a busy machine: what was (not) written, and what to do."""
    how = result.busy
    if not result.held:
        return (f"Warning: the machine was busy while measuring ({how}): the timings are noisy"
                + (f"; installed all the same ({param('force')})." if force else
                   "; rerun when it is idle for a table to rely on."))
    side = result.written[-1]
    return (f"Warning: the machine was busy while measuring ({how}), so the noisy table did not become the default: "
            f"{result.held[0]} is unchanged and the entries are in {side} (use them with --dispatch-table {side}); "
            f"rerun tune-dispatch when the machine is idle, or pass {param('force')} to install them anyway.")


def _read_table(path: Path):
    """The table at ``path`` (empty if none), or a ``UserError`` saying it is not one."""
    from ..dispatch import experts as dsp

    if not path.is_file():
        return dsp.Table()
    try:
        return dsp.read_table(path)
    except ValueError as e:
        raise UserError(f"{e}; fix or remove it first.") from None


def _measure_all(targets, ms_list, block_list, backend, measure, progress, log, on_entry) -> list:
    """Time every plan of every target (progress bars, ``on_entry`` per shape); the entries."""
    import mlx.core as mx
    from tqdm import tqdm

    from ..dispatch.tune import device_description, entry_from, parse_quant
    from ..dispatch.tune import measure as time_plans

    log(f"Device: {device_description()}  mlx {mx.__version__}")
    entries = []
    for item in targets:
        module, spec = item[0], item[1]
        if backend == "cpu" and spec.dtype != "float32" and parse_quant(spec.quant) is None:
            raise UserError(f"{spec.label()}: MLX's CPU gather_mm is float32 only, so float {spec.dtype} experts "
                            "cannot run on the CPU (mlx-lm's SwitchGLU fails too); tune float32 or on a GPU.")
        dequant = not measure.no_dequant and not (backend == "cpu" and spec.dtype != "float32")
        layer = module if module is not None else item[2](spec)
        total = len(ms_list)
        bar = tqdm(total=total, desc=spec.label(), unit="M", dynamic_ncols=True, leave=True, disable=not progress)
        seen_m = set()

        def report(text, bar=bar, seen=seen_m):
            m = text.split()[0]
            if m not in seen:
                if seen:
                    bar.update(1)
                seen.add(m)
            bar.set_postfix_str(text, refresh=True)

        try:
            meas = time_plans(layer, spec, ms=ms_list, blocks=block_list, dequant=dequant,
                              min_repeats=measure.repeats, progress=report)
        finally:
            bar.update(total - bar.n)
            bar.close()
        entry = entry_from(meas, margin=measure.margin)
        entries.append(entry)
        if on_entry is not None:
            on_entry(entry)
        del layer
    return entries


def _model_top_k(model, config: dict, override: int | None) -> int:
    """The override, else the adapter's top-k (config facts live on the adapters)."""
    from ..adapters import REGISTRY, get_adapter

    if override:
        return override
    if config.get("model_type") not in REGISTRY:
        raise UserError(f"model_type '{config.get('model_type')}' has no mlx-fun adapter to read its top-k from; "
                        f"pass {param('top_k')}.")
    return int(get_adapter(model, config).top_k)


def _specs_from_model(model_path: str, top_k: int | None, backend: str):
    """One (module, LayerSpec) per distinct expert key of the model (weights loaded lazily). Half-precision float
    experts on the CPU run in float32 (:func:`mlx_fun.dispatch.experts.half_on_cpu`): their entry (keyed by the stored
    dtype) is timed on a float32 layer of the same shape, ``(None, spec, build_layer)``."""
    import mlx.core as mx

    from ..dispatch.experts import LayerKey, expert_modules, half_on_cpu
    from ..dispatch.tune import build_layer, spec_of
    from ..model.io import load_model

    model, _tok, config = load_model(model_path, lazy=True, tokenizer=False)
    modules = expert_modules(model)
    if not modules:
        raise UserError(f"{model_path} has no mlx-lm SwitchGLU experts to tune.")
    k = _model_top_k(model, config, top_k)
    seen: dict = {}
    for module in modules:
        key = LayerKey.of(module)
        if key in seen:
            continue
        experts = key.E
        if k > experts:
            raise UserError(f"{param('top_k')} {k} is more than the {experts} experts of {model_path}'s MoE layers; "
                            f"pass a {param('top_k')} of at most {experts} (or leave it out for the model's own).")
        if half_on_cpu(module, backend):
            seen[key] = (None, spec_of(module, k, dtype=mx.float32), build_layer)
        else:
            seen[key] = (module, spec_of(module, k))
    return list(seen.values())


def _specs_from_shapes(shapes, quants, dtype, gpt_oss: bool, backend: str):
    from ..dispatch.tune import LayerSpec, build_layer, canonical_quant, parse_quant

    if not quants:
        quants = ("float32" if backend == "cpu" else "bfloat16", "affine4-g64")
    act = dtype or ("float32" if backend == "cpu" else "bfloat16")
    out = []
    for shape in shapes:
        dims = int_list(shape, "shape")
        if len(dims) != 4:
            raise UserError(f"{param('shape')} takes D,H,E,k (4 integers), got {shape!r}.")
        D, H, E, k = dims
        if k > E:
            raise UserError(f"{param('shape')} {shape}: k ({k}) must not exceed E ({E}).")
        for q in quants:
            try:
                quant = canonical_quant(q, act)
            except ValueError as e:
                raise UserError(str(e)) from None
            layer_dtype = quant if parse_quant(quant) is None else act
            spec = LayerSpec(D, H, E, k, quant, layer_dtype, bias=gpt_oss, oai=gpt_oss)
            out.append((None, spec, build_layer))
    return out
