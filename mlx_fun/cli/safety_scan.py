"""``mlx-fun safety-scan``: parses, calls :func:`mlx_fun.jobs.safety_scan.run`, prints."""

from __future__ import annotations

import click

from .common import (
    dispatch_option,
    echo_err,
    friendly_errors,
    model_option,
    run_settings,
    scan_options,
    token_budget_option,
)


@click.command("safety-scan", short_help="Harmful vs benign routing → safety_report.json (HCDG / HRCG experts).")
@model_option
@scan_options(("harmful-dataset", "benign-dataset"),
              ("Harmful prompts: JSONL (chats are read with their generation prompt) or a directory.",
               "Benign prompts, same formats."))
@dispatch_option
@token_budget_option
@friendly_errors
def command(**kwargs):
    """Find the experts whose routing differs between harmful and benign prompts (SAFEx-style): per expert the
    activation rate, mean router weight and mean gate logit on each set, their scaled differences averaged into
    a composite score, and SteerMoE's risk difference. HCDG experts are more active on harmful prompts, HRCG
    experts on benign ones; their union is `safety_critical`, which `prune --safety-map`, `serve` and `steer`
    read.

    \b
    Example (the bundled refusing chat model and its held-out-split prompt sets):
      mlx-fun safety-scan --model data/tiny-moe-chat --harmful-dataset data/safety/harmful_train.jsonl \\
          --benign-dataset data/safety/benign_train.jsonl --output safety_report.json --max-samples 256 --seed 0
    """
    from ..jobs import safety_scan

    settings = run_settings(kwargs)
    show(safety_scan.run(**kwargs, settings=settings, log=echo_err))


def show(result) -> None:
    sizes = ", ".join(f"{k} {v}" for k, v in result.group_sizes().items())
    tokens = ", ".join(f"{k} {v['tokens']:,} tokens" for k, v in result.report["datasets"].items())
    click.echo(f"Wrote {result.output} ({tokens}; experts: {sizes})")
