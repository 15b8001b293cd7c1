"""``mlx-fun tune-dispatch``: measure the MoE dispatch cut-offs of a model's expert shapes on this backend."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import UserError
from .common import FiniteFloat, friendly_errors

DEFAULT_MS = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096"


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).replace(" ", "").split(",") if v]
    except ValueError:
        raise UserError(f"{what} must be comma-separated integers, got {text!r}.") from None
    if not values or min(values) < 1:
        raise UserError(f"{what} must list positive integers, got {text!r}.")
    return values


def _model_top_k(model, config: dict, override: int | None) -> int:
    if override:
        return override
    try:
        from ..adapters import get_adapter

        return int(get_adapter(model, config).top_k)
    except Exception:
        pass
    text = config.get("text_config", config)
    for key in ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k", "moe_top_k"):
        if isinstance(text.get(key), int):
            return int(text[key])
    raise UserError("could not find the model's top-k in config.json; pass --top-k.")


def _specs_from_model(model_path: str, top_k: int | None):
    """One (module, LayerSpec) per distinct expert key of the model (weights loaded lazily)."""
    from ..dispatch import LayerKey, expert_modules
    from ..dispatch_tune import spec_of
    from ..io import load_model

    model, _tok, config = load_model(model_path, lazy=True)
    modules = expert_modules(model)
    if not modules:
        raise UserError(f"{model_path} has no mlx-lm SwitchGLU experts to tune.")
    k = _model_top_k(model, config, top_k)
    seen: dict = {}
    for module in modules:
        key = LayerKey.of(module)
        if key not in seen:
            seen[key] = (module, spec_of(module, k))
    return list(seen.values())


def _specs_from_shapes(shapes, quants, dtype, gpt_oss: bool, backend: str):
    from ..dispatch_tune import LayerSpec, build_layer, canonical_quant, parse_quant

    if not quants:
        quants = ("float32" if backend == "cpu" else "bfloat16", "affine4-g64")
    act = dtype or ("float32" if backend == "cpu" else "bfloat16")
    out = []
    for shape in shapes:
        dims = _int_list(shape, "--shape")
        if len(dims) != 4:
            raise UserError(f"--shape takes D,H,E,k (4 integers), got {shape!r}.")
        D, H, E, k = dims
        if k > E:
            raise UserError(f"--shape {shape}: k ({k}) must not exceed E ({E}).")
        for q in quants:
            try:
                quant = canonical_quant(q, act)
            except ValueError as e:
                raise UserError(str(e)) from None
            layer_dtype = quant if parse_quant(quant) is None else act
            spec = LayerSpec(D, H, E, k, quant, layer_dtype, bias=gpt_oss, oai=gpt_oss)
            out.append((None, spec, build_layer))
    return out


@click.command("tune-dispatch", short_help="Measure sort/no-sort/blocked/dequant cut-offs of MoE experts here.")
@click.option("--model", type=click.Path(), default=None,
              help="Local mlx-lm model directory: tune each distinct expert shape/quantization it has.")
@click.option("--shape", multiple=True, metavar="D,H,E,K",
              help="Instead of --model: a synthetic layer with these hidden, expert, expert-count and top-k sizes "
                   "(repeatable), e.g. 2048,768,128,8 (Qwen3-30B-A3B).")
@click.option("--quant", multiple=True,
              help="With --shape (repeatable): float32, bfloat16, float16, affine4[-g64], affine8, mxfp4, nvfp4, "
                   "mxfp8. Default: the float dtype of this backend (float32 on CPU, bfloat16 on a GPU) and affine4-g64.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="With --shape: activation (and scale) dtype of quantized layers (default float32 on CPU, "
                   "bfloat16 on a GPU).")
@click.option("--gpt-oss", is_flag=True, help="With --shape: gpt-oss experts (biases, clamped SwiGLU).")
@click.option("--top-k", type=click.IntRange(min=1), default=None, help="With --model: override the top-k from config.json.")
@click.option("--ms", default=DEFAULT_MS, show_default=True, help="Token counts M to measure.")
@click.option("--max-m", type=click.IntRange(min=1), default=None,
              help="Skip M above this (large M on a slow CPU takes minutes per call); the last band extends.")
@click.option("--blocks", default="8,16,32,64", show_default=True, help="Block sizes R tried for the blocked plans.")
@click.option("--no-dequant", is_flag=True, help="Do not try dequantize-then-gather_mm plans for quantized experts.")
@click.option("--margin", type=FiniteFloat(min=0.0, max=0.5), default=0.05, show_default=True,
              help="A plan replaces mlx-lm's only where it is at least this much (fraction) and 20 µs faster.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Minimum timed calls per plan and M (more for fast calls, up to 100; 1 for calls over 5 s).")
@click.option("--output", type=click.Path(dir_okay=False), default=None,
              help="Table file to write; entries are merged into it when it exists (same key: replaced). "
                   "Default: the user table that --dispatch auto reads ($MLX_FUN_DISPATCH_TABLE or "
                   "~/.cache/mlx-fun/dispatch_table.json).")
@click.option("--merge-into", type=click.Path(dir_okay=False), default=None,
              help="Also merge the new entries into this table (e.g. mlx_fun/dispatch_table.json of a checkout).")
@friendly_errors
def tune_dispatch_cmd(model, shape, quant, dtype, gpt_oss, top_k, ms, max_m, blocks, no_dequant, margin, repeats,
                      output, merge_into):
    """Measure, on the current backend (CPU, CUDA or Metal), how fast each expert dispatch plan runs a model's
    MoE layer for token counts M = 1 … 4096, and write the cut-offs that `--dispatch auto` uses.

    Plans: mlx-lm's rule, unsorted, sorted, blocked<R> (each expert's rows padded to blocks of R, one GEMM per
    block) and, for quantized experts, dequantize-then-gather_mm (per call, or cached with --dequant-cache).
    A plan replaces mlx-lm's only where it is --margin faster. Shows a progress bar; the file is written
    atomically. On a GPU, --shape 2048,768,128,8 --quant bfloat16 --quant affine4-g64 tunes a Qwen3-30B-A3B
    layer without the model (MLX's CPU backend has no bfloat16 gather_mm; use --quant float32 there).

    \b
    Example:
      mlx-fun tune-dispatch --model data/tiny-moe --max-m 256
    """
    import mlx.core as mx
    from tqdm import tqdm

    from .. import dispatch as dsp
    from ..dispatch_tune import device_description, measure, entry_from, parse_quant

    if bool(model) == bool(shape):
        raise UserError("pass either --model or --shape (not both).")
    ms_list = sorted(set(_int_list(ms, "--ms")))
    if max_m:
        ms_list = [m for m in ms_list if m <= max_m] or [min(ms_list)]
    block_list = sorted(set(_int_list(blocks, "--blocks")))
    backend = dsp.backend_name()

    if model:
        targets = _specs_from_model(model, top_k)
    else:
        targets = _specs_from_shapes(shape, quant, dtype, gpt_oss, backend)

    out_path = Path(output) if output else dsp.user_table_path()
    for path in (out_path, Path(merge_into) if merge_into else None):
        if path is not None and path.is_file():
            try:
                dsp.read_table(path)
            except ValueError as e:
                raise UserError(f"{e}; fix or remove it first.") from None

    click.echo(f"Device: {device_description()}  mlx {mx.__version__}", err=True)
    entries = []
    for item in targets:
        module, spec = item[0], item[1]
        if backend == "cpu" and spec.dtype != "float32" and parse_quant(spec.quant) is None:
            raise UserError(f"{spec.label()}: MLX's CPU gather_mm is float32 only, so float {spec.dtype} experts "
                            "cannot run on the CPU (mlx-lm's SwitchGLU fails too); tune float32 or on a GPU.")
        dequant = not no_dequant and not (backend == "cpu" and spec.dtype != "float32")
        layer = module if module is not None else item[2](spec)
        total = len(ms_list)
        bar = tqdm(total=total, desc=spec.label(), unit="M", dynamic_ncols=True, leave=True)
        seen_m = set()

        def progress(text, bar=bar, seen=seen_m):
            m = text.split()[0]
            if m not in seen:
                if seen:
                    bar.update(1)
                seen.add(m)
            bar.set_postfix_str(text, refresh=True)

        try:
            meas = measure(layer, spec, ms=ms_list, blocks=tuple(block_list), dequant=dequant,
                           min_repeats=repeats, progress=progress)
        finally:
            bar.update(total - bar.n)
            bar.close()
        entry = entry_from(meas, margin=margin)
        entries.append(entry)
        _print_entry(entry)
        del layer

    new = dsp.Table(entries)
    written = []
    for path in [out_path] + ([Path(merge_into)] if merge_into else []):
        target = dsp.read_table(path) if path.is_file() else dsp.Table()
        dsp.write_table(target.merged(new), path)
        written.append(str(path))
    click.echo(f"Wrote {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} to {', '.join(written)}")
    if not output:
        click.echo("--dispatch auto reads this user table from now on (smoke-test, eval).")


def _print_entry(entry) -> None:
    from ..dispatch_tune import speedup_table

    click.echo(f"\n{entry.describe()}")
    if entry.bands_cached:
        click.echo("  with --dequant-cache: " + ", ".join(f"M>={s}:{p}" for s, p in entry.bands_cached))
    click.echo(f"  {'M':>6}  {'plan':<22} {'mlx-lm ms':>11} {'ours ms':>11} {'speedup':>8}")
    for m, name, base, ours in speedup_table(entry):
        click.echo(f"  {m:>6}  {name:<22} {base:>11.3f} {ours:>11.3f} {base / ours:>7.2f}x")


COMMANDS = [tune_dispatch_cmd]
