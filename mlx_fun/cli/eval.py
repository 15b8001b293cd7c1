"""``mlx-fun eval``: parses, calls :func:`mlx_fun.jobs.eval.run`, prints."""

from __future__ import annotations

import sys

import click

from .common import (
    SEED,
    dispatch_option,
    echo_err,
    force_option,
    friendly_errors,
    model_option,
    run_settings,
    token_budget_option,
)


@click.command("eval", short_help="Perplexity per dataset; with --reference, next-token KL and top-1 agreement.")
@model_option
@click.option("--reference", type=click.Path(), default=None,
              help="Reference model (e.g. the original before pruning): a local directory or a Hugging Face repo "
                   "id, as --model (a local directory of that name wins; the repo at its default branch, since "
                   "--revision is --model's); adds ref ppl, KL and top-1 agreement.")
@click.option("--dataset", required=True, multiple=True, type=str,
              help="JSONL file or directory of text files (repeat for several; NAME=PATH names one). "
                   "Reported under the file stem or directory name.")
@click.option("--max-samples", type=click.IntRange(min=1), default=128, show_default=True,
              help="Score at most this many samples per dataset (a seeded random subset when it has more).")
@click.option("--max-tokens", type=click.IntRange(min=2), default=2048, show_default=True,
              help="Truncate every sample to this many tokens.")
@click.option("--text-key", default="content", show_default=True, help="JSON key of plain-text JSONL lines.")
@click.option("--seed", type=SEED, default=0, show_default=True,
              help="Seed of the random subset (fixed by default, so repeated runs score the same samples).")
@click.option("--batch-size", type=click.IntRange(min=1), default=4, show_default=True,
              help="Samples per forward pass (length-bucketed; padding is never scored).")
@click.option("--output", type=click.Path(), default=None, help="Also write the results as JSON to this file.")
@force_option()
@dispatch_option
@token_budget_option
@friendly_errors
def command(**kwargs):
    """Score MODEL on held-out text: perplexity per dataset (exp of the mean next-token negative
    log-likelihood over every predicted token). With --reference (typically the original of a pruned, merged
    or quantized MODEL), also the reference's perplexity on the same tokens, the mean next-token KL divergence
    KL(reference ‖ model) in nats, and top-1 agreement (how often both predict the same most likely token).

    \b
    Example (the held-out splits of `python -m scripts.tools.prepare_dataset --output corpus`):
      mlx-fun eval --model pruned --reference data/tiny-moe --dataset code=corpus/code/test.jsonl \\
          --dataset prose=corpus/prose/test.jsonl --max-samples 32 --max-tokens 512 --output eval.json

    Datasets use the formats of `collect` (JSONL messages / prompt+completion / text lines, or a directory of
    .txt/.sol files), tokenized with MODEL's tokenizer; model and reference must share the tokenizer. The
    same --seed selects the same samples in every run. Works with float and quantized models of any family
    that mlx-lm loads. Log-probabilities are computed in float32; padding is excluded.
    """
    from ..jobs import eval as eval_job

    settings = run_settings(kwargs)
    show(eval_job.run(**kwargs, settings=settings, log=echo_err))


def show(result) -> None:
    from ..observe.evaluate import format_results

    sys.stderr.flush()  # the progress bars' last newline before the table
    click.echo(format_results(result.results))
    click.echo(f"{result.tokens:,} tokens scored in {result.seconds:.1f} s "
               f"({result.tokens / max(result.seconds, 1e-9):,.0f} tok/s)", err=True)
    if result.output is not None:
        click.echo(f"Wrote {result.output}")
