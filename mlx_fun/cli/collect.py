"""``mlx-fun collect``: parses, calls :func:`mlx_fun.jobs.collect.run`, prints."""

from __future__ import annotations

import click

from .common import (
    dataset_options,
    dispatch_option,
    echo_err,
    force_option,
    friendly_errors,
    model_option,
    run_settings,
    token_budget_option,
)


@click.command("collect", short_help="Run calibration data through the model and save expert saliency (.npz).")
@model_option
@dataset_options
@click.option("--output", required=True, type=click.Path(),
              help="Where to write the saliency statistics (.npz); checked for room and writability before the run.")
@force_option()
@click.option(
    "--batch-size", type=click.IntRange(min=1), default=1, show_default=True,
    help="Samples per forward pass (length-bucketed, padding excluded from the statistics).",
)
@dispatch_option
@token_budget_option
@click.option("--pipeline", is_flag=True,
              help="Under mlx.launch: split the model's layers across the ranks (each loads only its own), for a "
                   "model no single machine holds; without it the ranks split the samples.")
@friendly_errors
def command(**kwargs):
    """Run calibration samples through every MoE layer of MODEL and record, per expert, how often it is
    chosen, its router weights and the norms of its outputs. The result feeds `prune`, `merge` and the
    `stats-*` commands.

    \b
    Example (on the bundled model, after `python -m scripts.tools.prepare_dataset --output corpus`):
      mlx-fun collect --model data/tiny-moe --dataset corpus/code/train.jsonl --output code.npz \\
          --max-samples 32 --max-tokens 512 --seed 42 --batch-size 4

    The .npz holds freq, weighted_freq_sum, reap_sum, ean_sum, reap_count, max_activation_norm (each
    num_moe_layers × num_experts) plus the model's identity (model_type, top_k, num_layers, num_experts,
    moe_layer_indices), which prune, merge and stats-* check before they use the file.

    
    Data-parallel under MLX's launcher (same file as one process; rank 0 writes it):
      mlx.launch --backend ring -n 2 -- mlx-fun collect --model data/tiny-moe \
          --dataset data/calibration_sample.jsonl --output code-2ranks.npz
    """
    from ..jobs import collect

    settings = run_settings(kwargs)
    show(collect.run(**kwargs, settings=settings, log=echo_err))


def show(result) -> None:
    if result.rank != 0:  # under mlx.launch: rank 0 wrote the file and reports it
        return
    click.echo(f"Wrote {result.output} ({result.tokens:,} tokens in {result.seconds:.1f} s, "
               f"{result.tokens / max(result.seconds, 1e-9):,.0f} tok/s)")
