"""``mlx-fun quantize``: parses, calls :func:`mlx_fun.jobs.quantize.run`, prints."""

from __future__ import annotations

import click

from ..jobs import quantize
from .common import echo_err, friendly_errors
from .options import job_kwargs, job_options

@click.command("quantize", short_help="MoE-aware mixed precision: router, dense parts and experts apart.")
@job_options(quantize.run)
@friendly_errors
def command(**kwargs):
    """Quantize a float MoE MODEL with one setting for its routed experts and another for the parts every
    token uses, keeping routers precise; write a directory plain mlx_lm.load() opens.

    \b
    Examples (on the bundled model; code.npz from `mlx-fun collect`):
      mlx-fun quantize --model data/tiny-moe --expert-bits 3 --dense-bits 4 --output runs/q3
      mlx-fun quantize --model data/tiny-moe --expert-mode mxfp4 --dense-bits 8 --output runs/qfp4
      mlx-fun quantize --model data/tiny-moe --expert-bits 4 --saliency runs/code.npz --cold-layers 2 \\
          --cold-bits 2 --output runs/q-cold

    mlx-lm keeps one setting per module, and a layer's routed experts are one stacked module, so --saliency
    works per layer: the --cold-layers layers whose experts have the smallest summed saliency get --cold-bits.
    quantize_metadata.json records the recipe and every module's setting.
    """
    show(quantize.run(**job_kwargs(quantize.run, kwargs), progress=True, log=echo_err))


def show(result) -> None:
    """The recipe, modules per class and setting, bits per weight and the size on disk."""
    from ..output.model_dir import dir_size
    from ..core.writer import fmt_bytes

    for kind in ("router", "experts", "dense"):
        parts = ", ".join(f"{n} × {s}" for s, n in result.modules.get(kind, {}).items()) or "none"
        click.echo(f"{kind:>8}: {parts}")
    if result.cold_layer_scores:
        click.echo("cold layers (summed saliency): " + ", ".join(
            f"{layer} ({score:.4g})" for layer, score in result.cold_layer_scores.items()))
    before, after = dir_size(result.model), dir_size(result.output)
    click.echo(f"{result.bits_per_weight:.2f} bits per weight; size on disk: {fmt_bytes(before)} → {fmt_bytes(after)} "
               f"({after / max(before, 1):.0%}); {result.seconds:.1f} s")
    click.echo(f"Wrote {result.output}")
