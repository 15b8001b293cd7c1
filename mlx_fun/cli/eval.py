"""``mlx-fun eval``: perplexity per dataset and, against a reference model, next-token KL and top-1 agreement."""

from __future__ import annotations

import contextlib
import math
import platform
import sys
import time
from pathlib import Path

import click

from .. import __version__
from ..errors import UserError
from .collect import warn_past_context
from .common import dispatch_option, friendly_errors, model_option


def _check_model_dir(path: str, option: str) -> dict:
    """Fail fast (before loading weights) on a missing directory or config."""
    from ..io import read_config

    if not Path(path).exists():
        raise UserError(f"{option} {path} does not exist; pass a local mlx-lm model directory.")
    config = read_config(path)
    if not isinstance(config, dict) or "model_type" not in config:
        raise UserError(f"{path}/config.json has no model_type; {option} must be an mlx-lm model directory.")
    return config


def _load(path: str, option: str):
    from ..io import load_model

    model, tokenizer, _ = load_model(path, lazy=True, flag=option)
    return model, tokenizer


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _versions() -> dict:
    from importlib import metadata

    import mlx.core as mx

    def version(dist: str):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {
        "mlx_fun": __version__,
        "mlx": version("mlx") or getattr(mx, "__version__", None),
        "mlx_lm": version("mlx-lm"),
        "python": platform.python_version(),
        "device": str(mx.default_device()),
    }


@click.command("eval", short_help="Perplexity per dataset; with --reference, next-token KL and top-1 agreement.")
@model_option
@click.option("--reference", type=click.Path(), default=None,
              help="Reference model directory (e.g. the original before pruning); adds ref ppl, KL and "
                   "top-1 agreement.")
@click.option("--dataset", "datasets", required=True, multiple=True, type=str,
              help="JSONL file or directory of text files (repeat for several; NAME=PATH names one). "
                   "Reported under the file stem or directory name.")
@click.option("--max-samples", type=click.IntRange(min=1), default=128, show_default=True,
              help="Score at most this many samples per dataset (a seeded random subset when it has more).")
@click.option("--max-tokens", type=click.IntRange(min=2), default=2048, show_default=True,
              help="Truncate every sample to this many tokens.")
@click.option("--text-key", default="content", show_default=True, help="JSON key of plain-text JSONL lines.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the random subset (fixed by default, so repeated runs score the same samples).")
@click.option("--batch-size", type=click.IntRange(min=1), default=4, show_default=True,
              help="Samples per forward pass (length-bucketed; padding is never scored).")
@click.option("--output", type=click.Path(), default=None, help="Also write the results as JSON to this file.")
@dispatch_option
@friendly_errors
def eval_cmd(model, reference, datasets, max_samples, max_tokens, text_key, seed, batch_size, output, dispatch):
    """Score MODEL on held-out text: perplexity per dataset (exp of the mean next-token negative
    log-likelihood over every predicted token). With --reference (typically the original of a pruned, merged
    or quantized MODEL), also the reference's perplexity on the same tokens, the mean next-token KL divergence
    KL(reference ‖ model) in nats, and top-1 agreement (how often both predict the same most likely token).

    \b
    Example (the held-out splits of `python scripts/prepare_dataset.py --output corpus`):
      mlx-fun eval --model pruned --reference data/tiny-moe --dataset code=corpus/code/test.jsonl \\
          --dataset prose=corpus/prose/test.jsonl --max-samples 32 --max-tokens 512 --output eval.json

    Datasets use the formats of `collect` (JSONL messages / prompt+completion / text lines, or a directory of
    .txt/.sol files), tokenized with MODEL's tokenizer; model and reference must share the tokenizer. The
    same --seed selects the same samples in every run. Works with float and quantized models of any family
    that mlx-lm loads. Log-probabilities are computed in float32; padding is excluded.
    """
    from .. import writer
    from ..evaluate import check_compatible, resolve_datasets

    model_config = _check_model_dir(model, "--model")
    ref_config = _check_model_dir(reference, "--reference") if reference is not None else None
    paths = resolve_datasets(datasets)
    if ref_config is not None:
        check_compatible(None, None, model_config, ref_config)
    inputs = {"--model": model, "--reference": reference, "--dataset": [str(p) for p in paths.values()]}
    with writer.output(output, kind="file", inputs=inputs) if output else contextlib.nullcontext() as res:
        report = _run(model, reference, paths, model_config=model_config, ref_config=ref_config,
                      max_samples=max_samples, max_tokens=max_tokens, seed=seed, text_key=text_key,
                      batch_size=batch_size, dispatch=dispatch)
        if res is not None:
            res.write_json(_json_safe(report))
    if output:
        click.echo(f"Wrote {output}")


def _run(model, reference, paths, *, model_config, ref_config, max_samples, max_tokens, seed, text_key,
         batch_size, dispatch) -> dict:
    """Load, score and print; return the report that ``--output`` writes."""
    from ..data import pad_id as batch_pad_id
    from ..evaluate import check_compatible, evaluate, format_results, load_eval_datasets

    click.echo(f"Loading {model} ...", err=True)
    mdl, tokenizer = _load(model, "--model")
    dispatch.apply(mdl, echo=lambda line: click.echo(line, err=True))
    ref = None
    if reference is not None:
        click.echo(f"Loading reference {reference} ...", err=True)
        ref, ref_tokenizer = _load(reference, "--reference")
        dispatch.apply(ref, echo=lambda line: click.echo(line, err=True))
        check_compatible(tokenizer, ref_tokenizer, model_config, ref_config)

    data = load_eval_datasets(
        paths, tokenizer, max_samples=max_samples, max_tokens=max_tokens, seed=seed, text_key=text_key
    )
    summary = ", ".join(f"{name}: {len(s)} samples" for name, s in data.items())
    click.echo(f"{model_config['model_type']}: {summary}", err=True)
    warn_past_context([x for samples in data.values() for x in samples], model_config, "--max-tokens")

    pad_id = batch_pad_id(tokenizer)
    start = time.perf_counter()
    results = evaluate(mdl, data, reference=ref, batch_size=batch_size, pad_id=pad_id, progress=True)
    elapsed = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results.values())

    sys.stderr.flush()  # the progress bars' last newline before the table
    click.echo(format_results(results))
    click.echo(f"{tokens:,} tokens scored in {elapsed:.1f} s ({tokens / max(elapsed, 1e-9):,.0f} tok/s)", err=True)

    return {
        "model": str(model),
        "reference": None if reference is None else str(reference),
        "model_type": model_config.get("model_type"),
        "quantization": model_config.get("quantization"),
        "reference_quantization": None if ref_config is None else ref_config.get("quantization"),
        "settings": {
            "max_samples": max_samples,
            "max_tokens": max_tokens,
            "seed": seed,
            "text_key": text_key,
            "batch_size": batch_size,
            "dispatch": dispatch.mode,
            "pad_id": pad_id,
        },
        "datasets": {name: {"path": str(paths[name]), **r} for name, r in results.items()},
        "elapsed_s": round(elapsed, 3),
        "versions": _versions(),
    }


COMMANDS = [eval_cmd]
