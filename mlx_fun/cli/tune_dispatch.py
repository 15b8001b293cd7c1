"""``mlx-fun tune-dispatch``: parses, calls :func:`mlx_fun.jobs.tune_dispatch.run`, prints."""

from __future__ import annotations

import click

from ..jobs import tune_dispatch
from .common import echo_err, friendly_errors
from .options import job_kwargs, job_options


@click.command("tune-dispatch", short_help="Measure sort/no-sort/blocked/dequant cut-offs of MoE experts here.")
@job_options(tune_dispatch.run)
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
    kwargs = job_kwargs(tune_dispatch.run, kwargs)
    show(tune_dispatch.run(**kwargs, progress=True, log=echo_err, on_entry=_print_entry))


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
