"""``mlx-fun eval``: parses, calls :func:`mlx_fun.jobs.eval.run`, prints."""

from __future__ import annotations

import dataclasses
import sys

import click

from ..jobs import eval as eval_job
from .common import echo_err, friendly_errors
from .options import job_kwargs, job_options


@click.command("eval", short_help="Perplexity per dataset; with --reference, next-token KL and top-1 agreement.")
@job_options(eval_job.run)
@friendly_errors
def command(**kwargs):
    """Score MODEL on held-out text: perplexity per dataset (exp of the mean next-token negative
    log-likelihood over every predicted token). With --reference (typically the original of a pruned, merged
    or quantized MODEL), also the reference's perplexity on the same tokens, the mean next-token KL divergence
    KL(reference ‖ model) in nats, and top-1 agreement (how often both predict the same most likely token).

    \b
    Example (the held-out splits of `python -m scripts.tools.prepare_dataset --output runs/corpus`):
      mlx-fun eval --model runs/pruned --reference data/tiny-moe --dataset code=runs/corpus/code/test.jsonl \\
          --dataset prose=runs/corpus/prose/test.jsonl --max-samples 32 --max-tokens 512 --output runs/eval.json

    Datasets use the formats of `collect` (JSONL messages / prompt+completion / text lines, or a directory of
    .txt/.sol files), tokenized with MODEL's tokenizer; model and reference must share the tokenizer. The
    same --seed selects the same samples in every run. Works with float and quantized models of any family
    that mlx-lm loads. Log-probabilities are computed in float32; padding is excluded.
    """
    kwargs = job_kwargs(eval_job.run, kwargs)
    kwargs["settings"] = dataclasses.replace(kwargs["settings"], progress=True)
    show(eval_job.run(**kwargs, log=echo_err))


def show(result) -> None:
    from ..observe.evaluate import format_results

    sys.stderr.flush()  # the progress bars' last newline before the table
    click.echo(format_results(result.results))
    click.echo(f"{result.tokens:,} tokens scored in {result.seconds:.1f} s "
               f"({result.tokens / max(result.seconds, 1e-9):,.0f} tok/s)", err=True)
    if result.output is not None:
        click.echo(f"Wrote {result.output}")
