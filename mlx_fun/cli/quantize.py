"""``mlx-fun quantize``: parses, calls :func:`mlx_fun.jobs.quantize.run`, prints."""

from __future__ import annotations

import click

from .common import echo_err, force_option, friendly_errors, metric_option, model_option, take

MODES = click.Choice(["affine", "mxfp4", "nvfp4", "mxfp8"])
BITS = click.Choice(["2", "3", "4", "5", "6", "8"])


@click.command("quantize", short_help="MoE-aware mixed precision: router, dense parts and experts apart.")
@model_option
@click.option("--output", required=True, type=click.Path(), help="Directory for the quantized model.")
@click.option("--expert-bits", type=BITS, default=None,
              help="Bits of the routed experts (affine)  [default: 4; mxfp4 / nvfp4 / mxfp8: their own].")
@click.option("--expert-mode", type=MODES, default="affine", show_default=True,
              help="Routed experts' format (mxfp4 / nvfp4: 4 bits, mxfp8: 8 bits).")
@click.option("--expert-group-size", type=int, default=None,
              help="Routed experts' (and cold layers') group size: affine 32, 64 or 128; mxfp4 / mxfp8 32; nvfp4 16. "
                   "Left out: the mode's default (64, 32, 32, 16).")
@click.option("--dense-bits", type=BITS, default=None,
              help="Bits of attention, shared experts, dense MLPs, embeddings and head  [default: 4; mxfp4 / nvfp4 "
                   "/ mxfp8: their own].")
@click.option("--dense-mode", type=MODES, default="affine", show_default=True, help="Their format.")
@click.option("--dense-group-size", type=int, default=None,
              help="Their group size (allowed values and default as for --expert-group-size).")
@click.option("--router-bits", type=click.Choice(["16", "8"]), default="16", show_default=True,
              help="16: routers stay in float; 8: 8-bit affine.")
@click.option("--saliency", type=click.Path(), default=None,
              help="Saliency .npz from `mlx-fun collect`: the coldest layers' experts get --cold-bits.")
@click.option("--cold-layers", type=click.IntRange(min=1), default=None, help="How many MoE layers count as cold.")
@click.option("--cold-bits", type=BITS, default=None,
              help="Bits of the cold layers' routed experts: fewer than --expert-bits.")
@click.option("--cold-mode", type=MODES, default=None, help="Their format (default --expert-mode).")
@metric_option()
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest output .safetensors file.")
@force_option("a non-empty --output directory")
@friendly_errors
def command(expert_bits, dense_bits, router_bits, cold_bits, **kwargs):
    """Quantize a float MoE MODEL with one setting for its routed experts and another for the parts every
    token uses, keeping routers precise; write a directory plain mlx_lm.load() opens.

    \b
    Examples (on the bundled model; code.npz from `mlx-fun collect`):
      mlx-fun quantize --model data/tiny-moe --expert-bits 3 --dense-bits 4 --output q3
      mlx-fun quantize --model data/tiny-moe --expert-mode mxfp4 --dense-bits 8 --output qfp4
      mlx-fun quantize --model data/tiny-moe --expert-bits 4 --saliency code.npz --cold-layers 2 \\
          --cold-bits 2 --output q-cold

    mlx-lm keeps one setting per module, and a layer's routed experts are one stacked module, so --saliency
    works per layer: the --cold-layers layers whose experts have the smallest summed saliency get --cold-bits.
    quantize_metadata.json records the recipe and every module's setting.
    """
    from ..jobs import quantize
    from ..rewrite.quantize import QuantRecipe

    as_int = lambda v: None if v is None else int(v)  # noqa: E731
    recipe = take(kwargs, QuantRecipe, expert_bits=as_int(expert_bits), dense_bits=as_int(dense_bits),
                  router_bits=int(router_bits), cold_bits=as_int(cold_bits))
    show(quantize.run(**kwargs, recipe=recipe, progress=True, log=echo_err))


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
