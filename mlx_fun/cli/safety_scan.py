"""``mlx-fun safety-scan``: parses, calls :func:`mlx_fun.jobs.safety_scan.run`, prints."""

from __future__ import annotations

import dataclasses

import click

from ..jobs import safety_scan
from .common import echo_err, friendly_errors
from .options import job_kwargs, job_options


@click.command("safety-scan", short_help="Harmful vs benign routing → safety_report.json (HCDG / HRCG experts).")
@job_options(safety_scan.run)
@friendly_errors
def command(**kwargs):
    """Find the experts whose routing differs between harmful and benign prompts (SAFEx-style counts): per expert
    the activation rate, mean router weight and mean gate logit on each set, SteerMoE's risk difference (the
    activation-rate difference) and a composite of the three scaled differences. Ranked as SteerMoE ranks, by the
    risk difference over all layers: HCDG experts (at or above --threshold-percentile, more active on harmful
    prompts) are what `steer` / `serve` activate (safe) or deactivate (unsafe); HRCG experts (at or below the
    complementary percentile, more active on benign ones) and HCDG together are `safety_critical`, which `prune
    --safety-map` and `abliterate --target safety-experts` read.

    \b
    Example (the bundled refusing chat model and its held-out-split prompt sets):
      mlx-fun safety-scan --model data/tiny-moe-chat --harmful-dataset data/safety/harmful_train.jsonl \\
          --benign-dataset data/safety/benign_train.jsonl --output runs/safety_report.json --max-samples 256 --seed 0
    """
    kwargs = job_kwargs(safety_scan.run, kwargs)
    kwargs["settings"] = dataclasses.replace(kwargs["settings"], progress=True)
    show(safety_scan.run(**kwargs, log=echo_err))


def show(result) -> None:
    sizes = ", ".join(f"{k} {v}" for k, v in result.group_sizes().items())
    tokens = ", ".join(f"{k} {v['tokens']:,} tokens" for k, v in result.report["datasets"].items())
    click.echo(f"Wrote {result.output} ({tokens}; experts: {sizes})")
