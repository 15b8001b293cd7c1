"""``mlx-fun prune``: parses, calls :func:`mlx_fun.jobs.prune.run`, prints."""

from __future__ import annotations

import click

from .common import echo_err, force_option, friendly_errors, metric_option, model_option, take


@click.command("prune", short_help="Remove the least salient experts (REAP) and save an mlx-lm model.")
@model_option
@click.option("--saliency", type=click.Path(), default=None, help="Saliency .npz from `mlx-fun collect`.")
@click.option("--expert-list", type=click.Path(), default=None,
              help="JSON/CSV list of experts to keep or remove per layer (see README); replaces --saliency/--n-prune.")
@click.option("--output", required=True, type=click.Path(), help="Directory for the pruned model (must not be --model).")
@click.option("--n-prune", type=click.IntRange(min=1), default=None,
              help="Experts to remove: per layer, or expert indices removed from every layer with --model-wide.")
@metric_option()
@click.option("--strategy", type=click.Choice(["bottom", "strided"]), default="bottom", show_default=True,
              help="bottom: remove the lowest scores; strided: spread removals over the saliency range.")
@click.option("--model-wide", is_flag=True, help="Remove the same expert indices from every layer (column sums).")
@click.option("--min-experts-per-layer", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --model-wide: never keep fewer experts than this in a layer.")
@click.option("--ignore-experts", default=None, help='With --model-wide: indices never pruned, e.g. "0,1,250..255".')
@click.option("--safety-map", type=click.Path(), default=None, help="Safety report JSON listing experts per layer (format: README, Report files).")
@click.option("--safety-mode", type=click.Choice(["protect", "target"]), default=None,
              help="protect: never prune safety-critical experts; target: prune them first.")
@click.option("--domain-map", type=click.Path(), default=None, help="Domain report JSON listing experts per layer (format: README, Report files).")
@click.option("--domain-mode", type=click.Choice(["protect"]), default=None, help="protect: never prune domain experts.")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="Largest output .safetensors file (e.g. 5GB, 500MB); more become shards with an index.")
@force_option("a non-empty --output directory")
@friendly_errors
def command(**kwargs):
    """Prune MODEL's routed experts by saliency and write a standard mlx-lm directory to OUTPUT.

    \b
    Examples (on the bundled model; filtered_experts.json is the README's expert-list example):
      mlx-fun prune --model data/tiny-moe --saliency code.npz --n-prune 8 --output pruned
      mlx-fun prune --model data/tiny-moe --saliency code.npz --n-prune 8 --model-wide \\
          --ignore-experts "0,1,30..31" --output pruned-wide
      mlx-fun prune --model data/tiny-moe --expert-list filtered_experts.json --output pruned-list

    Router rows, correction biases and every expert projection (quantized or not) are sliced; shared
    experts are kept. The result loads with plain mlx_lm.load(); reap_metadata.json records the kept experts.
    It streams: tensors are copied or sliced from the model's files one at a time (never decoded), so memory
    stays near the largest tensor, however large the model.
    """
    from ..jobs import prune
    from ..experts.selection import Selection

    selection = take(kwargs, Selection)
    show(prune.run(**kwargs, selection=selection, progress=True, log=echo_err))


def show(result) -> None:
    """Experts before → after per layer (and which were removed), then the size on disk."""
    E = result.num_experts
    click.echo(f"{'layer':>6} {'experts':>12}  removed")
    for pos, layer in enumerate(result.moe_layers):
        kept = set(result.keep_map.get(pos, range(E)))
        removed = [e for e in range(E) if e not in kept]
        shown = ", ".join(map(str, removed[:12])) + (f", … (+{len(removed) - 12})" if len(removed) > 12 else "")
        click.echo(f"{layer:>6} {E:>5} → {len(kept):<4}  {shown}")
    echo_size_summary(result.model, result.output, E, result.kept, result.seconds)


def echo_size_summary(model, output, n_before: int, n_after: int, elapsed: float) -> None:
    """The closing lines of prune and merge: size on disk before → after, experts per layer, time."""
    from ..output.model_dir import dir_size
    from ..core.writer import fmt_bytes

    before, after = dir_size(model), dir_size(output)
    click.echo(f"size on disk: {fmt_bytes(before)} → {fmt_bytes(after)} ({after / max(before, 1):.0%}); "
               f"{n_before} → {n_after} experts per layer; {elapsed:.1f} s")
    click.echo(f"Wrote {output}")
