"""Shared click options and the error handling every command uses."""

from __future__ import annotations

import functools
import sys

import click

from ..errors import UserError
from ..saliency import METRICS


def friendly_errors(fn):
    """Turn ``UserError`` into ``Error: <message>`` on stderr and exit code 2 (nothing written)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            click.echo(f"Error: {e}", err=True)
            sys.exit(2)

    return wrapper


def model_option(fn):
    return click.option(
        "--model",
        required=True,
        type=click.Path(),
        help="Local mlx-lm model directory (config.json + safetensors + tokenizer). Never downloaded.",
    )(fn)


def metric_option(default: str = "reap"):
    return click.option(
        "--metric",
        type=click.Choice(METRICS),
        default=default,
        show_default=True,
        help="Saliency metric: reap = mean(‖y‖·w), ean = mean(‖y‖), freq = routed count, weighted_freq = Σw.",
    )


def dataset_options(fn):
    """--dataset/--max-samples/--max-tokens/--text-key/--seed, shared by every command that reads data."""
    fn = click.option("--seed", type=int, default=None, help="Seed for the random subset of samples.")(fn)
    fn = click.option(
        "--text-key", default="content", show_default=True, help="JSON key of plain-text JSONL lines."
    )(fn)
    fn = click.option(
        "--max-tokens", type=click.IntRange(min=1), default=2048, show_default=True,
        help="Truncate every sample to this many tokens.",
    )(fn)
    fn = click.option(
        "--max-samples", type=click.IntRange(min=1), default=128, show_default=True,
        help="Use at most this many samples (a random subset when the dataset has more).",
    )(fn)
    fn = click.option(
        "--dataset", required=True, type=click.Path(),
        help="JSONL file (messages / prompt+completion / text lines, detected per line) or a directory of files.",
    )(fn)
    return fn
