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


def check_output_file(output: str, inputs: tuple[str, ...] = ()) -> Path:
    out = Path(output)
    if out.is_dir():
        raise UserError(f"--output {out} is a directory; give a file path such as {out / 'saliency.npz'}.")
    for path in inputs:
        if Path(path).exists() and out.resolve() == Path(path).resolve():
            raise UserError(f"--output {out} is also an input; choose a different output path.")
    return out


@click.command("collect", short_help="Run calibration data through the model and save expert saliency (.npz).")
@model_option
@dataset_options
@click.option("--output", required=True, type=click.Path(), help="Where to write the saliency statistics (.npz).")
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
    Example:
      mlx-fun collect --model ./my-moe --dataset calib.jsonl --output saliency.npz --max-samples 128 --seed 42

    The .npz holds freq, weighted_freq_sum, reap_sum, ean_sum, reap_count, max_activation_norm (each
    num_moe_layers × num_experts) plus model_type, num_layers, num_experts and moe_layer_indices.
    """
    from ..adapters import get_adapter
    from ..collect import collect
    from ..data import load_samples
    from ..data import pad_id as batch_pad_id
    from ..io import load_model

    check_supported(model)
    if not Path(dataset).exists():
        raise UserError(f"dataset {dataset} does not exist; pass a JSONL file or a directory of text files.")
    out = check_output_file(output, (dataset,))

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
    pad_id = batch_pad_id(tokenizer)
    start = time.perf_counter()
    acc = collect(mdl, adapter, samples, batch_size=batch_size, pad_id=pad_id, progress=True)
    elapsed = time.perf_counter() - start
    acc.save(out)
    click.echo(
        f"Wrote {out} ({acc.total_tokens:,} tokens in {elapsed:.1f} s, {acc.total_tokens / max(elapsed, 1e-9):,.0f} tok/s)"
    )


COMMANDS = [collect_cmd]
