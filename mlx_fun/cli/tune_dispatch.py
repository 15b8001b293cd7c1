"""``mlx-fun tune-dispatch``: parses, calls :func:`mlx_fun.jobs.tune_dispatch.run`, prints."""

from __future__ import annotations

import click

from ..jobs.tune_dispatch import DEFAULT_MS
from .common import FiniteFloat, echo_err, force_option, friendly_errors, take


@click.command("tune-dispatch", short_help="Measure sort/no-sort/blocked/dequant cut-offs of MoE experts here.")
@click.option("--model", type=click.Path(), default=None,
              help="An mlx-lm model (a local directory, or a Hugging Face repo id as in --model of the other commands): "
                   "tune each distinct expert shape/quantization it has.")
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
              help="Table file to write; an existing one only with --force, which merges the entries into it "
                   "(same key: replaced). Default: the user table that --dispatch auto reads, merged into "
                   "($MLX_FUN_DISPATCH_TABLE or "
                   "~/.cache/mlx-fun/dispatch_table.json).")
@force_option("an existing --output table, keeping its other entries")
@click.option("--merge-into", type=click.Path(dir_okay=False), default=None,
              help="Also merge the new entries into this table (e.g. mlx_fun/dispatch/dispatch_table.json of a checkout).")
@friendly_errors
def command(**kwargs):
    """Measure, on the current backend (CPU, CUDA or Metal), how fast each expert dispatch plan runs a model's
    MoE layer for token counts M = 1 … 4096, and write the cut-offs that `--dispatch auto` uses.

    Plans: mlx-lm's rule, unsorted, sorted, blocked<R> (each expert's rows padded to blocks of R, one GEMM per
    block) and, for quantized experts, dequantize-then-gather_mm (per call, or cached with --dequant-cache).
    A plan replaces mlx-lm's only where it is --margin faster. Shows a progress bar; the file is written
    atomically. On a GPU, --shape 2048,768,128,8 --quant bfloat16 --quant affine4-g64 tunes a Qwen3-30B-A3B
    layer without the model (MLX's CPU backend has no bfloat16 gather_mm; use --quant float32 there: a
    bfloat16 model's experts run in float32 on the CPU, and --model times them so).

    \b
    Example:
      mlx-fun tune-dispatch --model data/tiny-moe --max-m 256
    """
    from ..dispatch.tune_options import Measurement
    from ..jobs import tune_dispatch

    measure = take(kwargs, Measurement)
    show(tune_dispatch.run(**kwargs, measure=measure, progress=True, log=echo_err, on_entry=_print_entry))


def show(result) -> None:
    n = len(result.entries)
    click.echo(f"Wrote {n} entr{'y' if n == 1 else 'ies'} to {', '.join(result.written)}")
    if result.user_table:
        click.echo("--dispatch auto reads this user table from now on (collect, merge, eval, smoke-test).")


def _print_entry(entry) -> None:
    from ..dispatch.tune import speedup_table

    click.echo(f"\n{entry.describe()}")
    if entry.bands_cached:
        click.echo("  with --dequant-cache: " + ", ".join(f"M>={s}:{p}" for s, p in entry.bands_cached))
    click.echo(f"  {'M':>6}  {'plan':<22} {'mlx-lm ms':>11} {'ours ms':>11} {'speedup':>8}")
    for m, name, base, ours in speedup_table(entry):
        click.echo(f"  {m:>6}  {name:<22} {base:>11.3f} {ours:>11.3f} {base / ours:>7.2f}x")
