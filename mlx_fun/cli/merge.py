"""``mlx-fun merge``: parses, calls :func:`mlx_fun.jobs.merge.run`, prints."""

from __future__ import annotations

import click

from .common import (
    SEED,
    echo_err,
    force_option,
    friendly_errors,
    metric_option,
    model_option,
    run_settings,
    take,
    token_budget_option,
)
from .prune import echo_size_summary


@click.command("merge", short_help="Merge experts into fewer centroids (REAM) and save an mlx-lm model.")
@model_option
@click.option("--saliency", type=click.Path(), default=None,
              help="Saliency .npz from `mlx-fun collect`: picks the centroids (with --n-prune) and weights the "
                   "averages (with --expert-list: only weights them).")
@click.option("--expert-list", type=click.Path(), default=None,
              help="JSON/CSV list of experts per layer; its kept experts are the centroids (replaces --n-prune).")
@click.option("--dataset", required=True, type=click.Path(),
              help="Calibration data for similarity and alignment (JSONL or a directory, as for collect).")
@click.option("--output", required=True, type=click.Path(),
              help="Directory for the merged model (must not be --model).")
@click.option("--n-prune", type=click.IntRange(min=1), default=None,
              help="Experts merged away per layer (or expert indices, with --model-wide); E - n centroids stay.")
@metric_option()
@click.option("--model-wide", is_flag=True, help="Keep the same centroid indices in every layer (column sums).")
@click.option("--min-experts-per-layer", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --model-wide: never keep fewer centroids than this in a layer.")
@click.option("--ignore-experts", default=None,
              help='With --model-wide: indices always kept as centroids, e.g. "0,1,250..255".')
@click.option("--similarity-mode", type=click.Choice(["gated", "average"]), default="gated", show_default=True,
              help="gated: cosine of router-probability-weighted mean outputs; average: of plain mean outputs. "
                   "Both are averaged with the router-logit correlation.")
@click.option("--alignment", type=click.Choice(["hungarian", "greedy", "none"]), default="hungarian", show_default=True,
              help="Neuron alignment before averaging: hungarian (optimal), greedy (fast), none.")
@click.option("--max-group-size", type=click.IntRange(min=1), default=16, show_default=True,
              help="Most experts per merge group, centroid included (REAM's C). Never exceeded: a size too "
                   "small for the centroids to hold every expert is refused, naming the smallest that works.")
@click.option("--max-samples", type=click.IntRange(min=1), default=64, show_default=True,
              help="Calibration samples (a random subset when the dataset has more).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Truncate every sample to this many tokens.")
@click.option("--max-similarity-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="Tokens (random subset) on which every expert is run to measure similarity.")
@click.option("--max-alignment-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="Tokens (subset of the similarity tokens) whose activations align neurons.")
@click.option("--text-key", default="content", show_default=True, help="JSON key of plain-text JSONL lines.")
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True,
              help="Samples per forward pass while hidden states are pushed through the layers.")
@click.option("--seed", type=SEED, default=None, help="Seed for the sample subset and the token subsets.")
@force_option("a non-empty --output directory")
@click.option("--dispatch", type=click.Choice(["auto", "mlx-lm"]), default="auto", show_default=True,
              help="MoE expert dispatch for the calibration forwards (see `mlx-fun eval --help`).")
@click.option("--dispatch-table", type=click.Path(dir_okay=False), default=None,
              help="Extra cut-off table (JSON from `mlx-fun tune-dispatch`).")
@token_budget_option
@friendly_errors
def command(**kwargs):
    """Merge MODEL's routed experts around the most salient ones (REAM) and write an mlx-lm directory to OUTPUT.

    \b
    Examples (on the bundled model; filtered_experts.json is the README's expert-list example):
      mlx-fun merge --model data/tiny-moe --saliency code.npz --n-prune 8 --dataset corpus/code/train.jsonl \\
          --output merged --max-samples 16 --max-tokens 512 --seed 42
      mlx-fun merge --model data/tiny-moe --expert-list filtered_experts.json --dataset corpus/code/train.jsonl \\
          --output merged-list --max-samples 16 --max-tokens 512

    Each non-centroid expert joins its most similar centroid with room (groups of at most --max-group-size);
    members'
    neurons are aligned to the centroid's and the group is averaged with saliency weights; the centroid's
    router row is kept. Layers are processed in order with hidden states carried forward through the merged
    layers (one pass over the calibration data). Quantized models stay quantized (same bits / group size /
    mode); the result is the size of a pruned model with the same expert count and loads with plain
    mlx_lm.load(). ream_metadata.json records centroids and groups.
    """
    from ..jobs import merge
    from ..rewrite.merge_options import Ream
    from ..experts.selection import Selection

    selection, ream, settings = take(kwargs, Selection), take(kwargs, Ream), run_settings(kwargs)
    show(merge.run(**kwargs, selection=selection, ream=ream, settings=settings, log=echo_err))


def show(result) -> None:
    """Per layer: experts before → centroids, experts merged, the largest group, seconds; then the size."""
    meta = result.metadata
    click.echo(f"{'layer':>6} {'experts':>12}  {'merged':>6}  {'largest':>7}  {'s':>6}")
    for layer in result.moe_layers:
        groups = meta["group_map"][str(layer)]
        merged = sum(len(m) - 1 for m in groups.values())
        largest = max(len(m) for m in groups.values())
        click.echo(f"{layer:>6} {result.num_experts:>5} → {result.kept:<4}  {merged:>6}  {largest:>7}  "
                   f"{meta['layer_seconds'][str(layer)]:>6.2f}")
    echo_size_summary(result.model, result.output, result.num_experts, result.kept, result.seconds)
