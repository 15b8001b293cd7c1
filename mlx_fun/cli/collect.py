"""``mlx-fun collect``: parses, calls :func:`mlx_fun.jobs.collect.run`, prints."""

from __future__ import annotations

import dataclasses

import click

from ..jobs import collect
from .common import echo_err, friendly_errors
from .options import job_kwargs, job_options


@click.command("collect", short_help="Run calibration data through the model and save expert saliency (.npz).")
@job_options(collect.run)
@friendly_errors
def command(**kwargs):
    """Run calibration samples through every MoE layer of MODEL and record, per expert, how often it is
    chosen, its router weights and the norms of its outputs. The result feeds `prune`, `merge` and the
    `stats-*` commands.

    \b
    Example (on the bundled model, after `python -m scripts.tools.prepare_dataset --output runs/corpus`):
      mlx-fun collect --model data/tiny-moe --dataset runs/corpus/code/train.jsonl --output runs/code.npz \\
          --max-samples 32 --max-tokens 512 --seed 42 --batch-size 4

    The .npz holds freq, weighted_freq_sum, reap_sum, ean_sum, reap_count, max_activation_norm (each
    num_moe_layers × num_experts) plus the model's identity (model_type, top_k, num_layers, num_experts,
    moe_layer_indices), which prune, merge and stats-* check before they use the file.

    
    Data-parallel under MLX's launcher (same file as one process; rank 0 writes it):
      mlx.launch --backend ring -n 2 -- mlx-fun collect --model data/tiny-moe \
          --dataset data/calibration_sample.jsonl --output runs/code-2ranks.npz
    """
    kwargs = job_kwargs(collect.run, kwargs)
    kwargs["settings"] = dataclasses.replace(kwargs["settings"], progress=True)
    show(collect.run(**kwargs, log=echo_err))


def show(result) -> None:
    if result.rank != 0:  # under mlx.launch: rank 0 wrote the file and reports it
        return
    from ..core.sizes import format_bytes

    streamed = ", one decoder layer at a time" if result.streamed else ""
    streamed += ", hidden states spilled to disk" if result.spilled else ""
    if result.device_peak_bytes is not None:
        streamed = f"; GPU peak {format_bytes(result.device_peak_bytes)}{streamed}"
    click.echo(f"Wrote {result.output} ({result.tokens:,} tokens in {result.seconds:.1f} s, "
               f"{result.tokens / max(result.seconds, 1e-9):,.0f} tok/s; peak memory {format_bytes(result.peak_bytes)}"
               f"{streamed})")
