"""``mlx-fun collect``: calibration data → per-layer × per-expert saliency statistics (.npz)."""

from __future__ import annotations

import time
from pathlib import Path

import click

from ..errors import UserError
from .common import dataset_options, friendly_errors, model_option


def check_supported(model_path: str) -> dict:
    """Fail fast (before loading weights) on a missing model or an unsupported ``model_type``."""
    from ..adapters import REGISTRY, supported_model_types
    from ..io import read_config

    config = read_config(model_path)
    if config.get("model_type") not in REGISTRY:
        raise UserError(
            f"model_type '{config.get('model_type')}' of {model_path} is not supported; "
            f"supported types: {', '.join(supported_model_types())}."
        )
    return config


@click.command("collect", short_help="Run calibration data through the model and save expert saliency (.npz).")
@model_option
@dataset_options
@click.option("--output", required=True, type=click.Path(),
              help="Where to write the saliency statistics (.npz); checked for room and writability before the run.")
@click.option(
    "--batch-size", type=click.IntRange(min=1), default=1, show_default=True,
    help="Samples per forward pass (length-bucketed, padding excluded from the statistics).",
)
@friendly_errors
def collect_cmd(model, dataset, max_samples, max_tokens, text_key, seed, output, batch_size):
    """Run calibration samples through every MoE layer of MODEL and record, per expert, how often it is
    chosen, its router weights and the norms of its outputs. The result feeds `prune`, `merge` and the
    `stats-*` commands.

    \b
    Example (on the bundled model, after `python scripts/prepare_dataset.py --output corpus`):
      mlx-fun collect --model data/tiny-moe --dataset corpus/code/train.jsonl --output code.npz \\
          --max-samples 32 --max-tokens 512 --seed 42 --batch-size 4

    The .npz holds freq, weighted_freq_sum, reap_sum, ean_sum, reap_count, max_activation_norm (each
    num_moe_layers × num_experts) plus the model's identity (model_type, top_k, num_layers, num_experts,
    moe_layer_indices), which prune, merge and stats-* check before they use the file.
    """
    from ..adapters import get_adapter
    from ..collect import collect
    from ..data import load_samples
    from ..data import pad_id as batch_pad_id
    from ..io import load_model
    from ..saliency import ARRAY_KEYS
    from .. import writer

    config = check_supported(model)
    if not Path(dataset).exists():
        raise UserError(f"dataset {dataset} does not exist; pass a JSONL file or a directory of text files.")
    with writer.output(output, kind="file", suffix=".npz", inputs={"--model": model, "--dataset": dataset}) as res:
        click.echo(f"Loading {model} ...", err=True)
        mdl, tokenizer, config = load_model(model)
        adapter = get_adapter(mdl, config)
        samples = load_samples(
            dataset, tokenizer, max_samples=max_samples, max_tokens=max_tokens, text_key=text_key, seed=seed
        )
        n_tokens = sum(len(s) for s in samples)
        click.echo(
            f"{adapter.model_type}: {len(adapter.moe_layers())} MoE layers × {adapter.num_experts} experts, "
            f"top-{adapter.top_k}; {len(samples)} samples, {n_tokens:,} tokens",
            err=True,
        )
        warn_past_context(samples, config, "--max-tokens")
        res.require_space(8 * len(ARRAY_KEYS) * len(adapter.moe_layers()) * adapter.num_experts)
        start = time.perf_counter()
        acc = collect(mdl, adapter, samples, batch_size=batch_size, pad_id=batch_pad_id(tokenizer), progress=True)
        elapsed = time.perf_counter() - start
        acc.write_npz(res.tmp)
    click.echo(
        f"Wrote {output} ({acc.total_tokens:,} tokens in {elapsed:.1f} s, "
        f"{acc.total_tokens / max(elapsed, 1e-9):,.0f} tok/s)"
    )


def warn_past_context(samples, config: dict, flag: str) -> None:
    """A warning line when samples are longer than the model's context (their tail is extrapolation)."""
    from ..io import context_length

    limit = context_length(config)
    longer = sum(len(s) > limit for s in samples) if limit else 0
    if longer:
        click.echo(f"Warning: {longer} sample(s) are longer than the model's context of {limit:,} tokens "
                   f"(max_position_embeddings); positions past it were never trained. Lower {flag} to {limit}.",
                   err=True)


COMMANDS = [collect_cmd]
