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


def dispatch_option(fn):
    """--dispatch [auto|mlx-lm], --dispatch-table PATH, --dequant-cache SIZE, bundled into one ``dispatch``
    argument (a :class:`mlx_fun.dispatch.DispatchSettings`); call ``dispatch.apply(model)`` after loading.

    Usage in a command: ``@dispatch_option`` among the options, a ``dispatch`` parameter, then
    ``dispatch.apply(model, echo=lambda s: click.echo(s, err=True))``.
    """

    @functools.wraps(fn)
    def wrapper(*args, dispatch, dispatch_table, dequant_cache, **kwargs):
        from ..dispatch import DispatchSettings, parse_bytes

        try:
            budget = parse_bytes(dequant_cache)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--dequant-cache") from None
        return fn(*args, dispatch=DispatchSettings(dispatch, dispatch_table, budget), **kwargs)

    wrapper = click.option(
        "--dequant-cache", default="0", show_default=True, metavar="SIZE",
        help="With --dispatch auto: memory allowed for keeping dequantized experts of quantized layers "
             "(e.g. 4GiB; K/M/G are powers of 1024), used where the table says it is faster. 0 = off.",
    )(wrapper)
    wrapper = click.option(
        "--dispatch-table", type=click.Path(dir_okay=False), default=None,
        help="Extra cut-off table (JSON from `mlx-fun tune-dispatch`) over the shipped and user tables.",
    )(wrapper)
    wrapper = click.option(
        "--dispatch", type=click.Choice(["auto", "mlx-lm"]), default="auto", show_default=True,
        help="MoE expert dispatch: auto picks sorted/unsorted/blocked/dequantized per token count from measured "
             "per-backend cut-offs; mlx-lm keeps mlx-lm's fixed rule (sort when indices.size >= 64).",
    )(wrapper)
    return wrapper
