"""``mlx-fun merge``: parses, calls :func:`mlx_fun.jobs.merge.run`, prints."""

from __future__ import annotations

import dataclasses

import click

from ..jobs import merge
from .common import echo_err, friendly_errors
from .options import job_kwargs, job_options
from .prune import echo_size_summary


@click.command("merge", short_help="Merge experts into fewer centroids (REAM) and save an mlx-lm model.")
@job_options(merge.run, skip=("dequant_cache",))  # merge refuses any dequantized-experts cache: no such option
@friendly_errors
def command(**kwargs):
    """Merge MODEL's routed experts around the most salient ones (REAM) and write an mlx-lm directory to OUTPUT.

    \b
    Examples (on the bundled model; runs/filtered_experts.json: docs/guide/commands.md):
      mlx-fun merge --model data/tiny-moe --n-prune 8 --dataset runs/corpus/code/train.jsonl \\
          --output runs/merged --max-samples 16 --max-tokens 512 --seed 42
      mlx-fun merge --model data/tiny-moe --expert-list runs/filtered_experts.json \\
          --dataset runs/corpus/code/train.jsonl --output runs/merged-list --max-samples 16 --max-tokens 512

    Each layer's centroids are its most salient experts (or the expert list's kept ones). The saliency is
    REAM's own by default (--saliency-source layerwise): measured as the layer is reached, on the hidden states
    of the already merged layers before it; --saliency-source file ranks by the --saliency file instead.
    Each non-centroid expert joins its most similar centroid with room (groups of at most --max-group-size);
    members'
    neurons are aligned to the centroid's and the group is averaged with saliency weights; the centroid's
    router row is kept. Layers are processed in order with hidden states carried forward through the merged
    layers (one pass over the calibration data). Quantized models stay quantized (same bits / group size /
    mode); the result is the size of a pruned model with the same expert count and loads with plain
    mlx_lm.load(). ream_metadata.json records centroids and groups.

    With --stream-layers (automatic when the weights exceed the memory left) one decoder layer's weights are in
    memory at a time: each merged layer is saved to .OUTPUT.stream/ beside OUTPUT with the hidden states after
    it, so rerunning the same command after a kill resumes at the next layer; the output, assembled from those
    files, equals the in-memory merge's bit for bit, and the directory is removed once it is written.
    """
    kwargs = job_kwargs(merge.run, kwargs)
    kwargs["settings"] = dataclasses.replace(kwargs["settings"], progress=True)
    show(merge.run(**kwargs, log=echo_err))


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
    from ..core.sizes import format_bytes

    streamed = ", one decoder layer at a time" if result.streamed else ""
    echo_size_summary(result.model, result.output, result.num_experts, result.kept, result.seconds,
                      f"; peak memory {format_bytes(result.peak_bytes)}{streamed}")
