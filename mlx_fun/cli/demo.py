"""``mlx-fun demo``: calls :func:`mlx_fun.jobs.demo.run`, printing every step's command line and result."""

from __future__ import annotations

import importlib

import click

from ..jobs import demo
from .common import echo_err, friendly_errors
from .options import job_kwargs, job_options


@click.command("demo", short_help="Run the whole job (collect → prune → smoke-test → eval) on the bundled model.")
@job_options(demo.run)
@friendly_errors
def command(**kwargs):
    """Compress the bundled trained MoE with REAP and measure what it cost — no arguments, no network.

    \b
    1. prepare  standard-library text (code + prose, train/validation/test) into OUTPUT/corpus
    2. collect  expert saliency on the calibration domain's train split
    3. prune    the least salient 25% of experts per layer (REAP) → OUTPUT/pruned
    4. smoke-test the pruned model (greedy)
    5. eval     pruned vs original on held-out code and prose (perplexity, KL, top-1 agreement)

    Every step prints the command it runs, so you can re-run any of them by hand on your own model.

    \b
    Example:
      mlx-fun demo
    """
    kwargs = job_kwargs(demo.run, kwargs)
    _echo_blas()
    show(demo.run(**kwargs, announce=_announce, report=_report, progress=True, log=echo_err))


def show(result) -> None:
    click.secho(f"\n== summary ({result.metric} pruning, calibrated on {result.calibration}; "
                f"{result.seconds:.0f} s)", bold=True)
    click.echo(result.summary)
    click.echo(result.agreement)
    click.echo(f"Outputs in {result.output}/ (pruned model, saliency.npz, eval.json, summary.md)")


def _announce(title: str, cmdline: str) -> None:
    click.secho(f"\n== {title}", bold=True)
    click.echo(f"$ {cmdline}")


def _report(name: str, result) -> None:
    """Each step's result as its own command prints it."""
    if name == "prepare":
        click.secho("== prepare data", bold=True)
        for domain, entry in result["domains"].items():
            counts = ", ".join(f"{s} {v['samples']}" for s, v in entry["splits"].items())
            click.echo(f"{domain}: {entry['source']} ({counts} samples)")
        return
    if name == "smoke-test":
        click.echo(result.generation.text, nl=False)
    importlib.import_module(f"{__package__}.{name.replace('-', '_')}").show(result)


def _echo_blas() -> None:
    """Which BLAS the CPU runs on, and what a slow one costs (measured on 2 cores: 25 s vs 115 s)."""
    from ..runtime.blas import blas_status

    status = blas_status()
    click.echo(status)
    if "preloaded" not in status and "not needed" not in status:
        click.echo("Warning: with the reference BLAS this demo takes about 5x longer (115 s instead of 25 s on "
                   "2 CPU cores); `mlx-fun doctor` shows the BLAS in use.", err=True)
