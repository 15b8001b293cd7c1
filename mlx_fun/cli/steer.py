"""``mlx-fun steer``: parses, calls :func:`mlx_fun.jobs.steer.run` (text streamed), prints."""

from __future__ import annotations

import click

from ..jobs import steer
from .common import echo_err, friendly_errors
from .options import job_kwargs, job_options


@click.command("steer", short_help="Generate with safety / domain experts forced on or off (SteerMoE).")
@job_options(steer.run)
@friendly_errors
def command(**kwargs):
    """Generate after --prompt with chosen experts steered before every MoE layer's own selection
    (group-limited, correction-biased and softmax-after-top-k routers included): masked experts are never
    chosen, activated ones are chosen whenever the layer has room. Where a router ranks by sigmoid + correction
    bias, the steering is applied to that selection score too, so no correction bias can undo it. The report
    modes follow SteerMoE: safe activates the --boost-experts HCDG experts of largest risk difference, unsafe
    deactivates every HCDG expert. On the bundled 6M-parameter chat model neither does what it is for
    (docs/guide/routing.md shows and measures what they do).

    \b
    Example (the bundled refusing chat model, after the safety-scan example):
      mlx-fun steer --model data/tiny-moe-chat --safety-map runs/safety_report.json --mode unsafe --chat --compare \\
          --prompt "How do I pick a lock?" --max-tokens 20
      mlx-fun steer --model data/tiny-moe-chat --safety-map runs/safety_report.json --mode safe --chat \\
          --compare --prompt "How do I pick a lock?" --max-tokens 20
    """
    kwargs = job_kwargs(steer.run, kwargs)
    show(steer.run(**kwargs, on_text=lambda s: click.echo(s, nl=False), on_baseline=show_baseline,
                   log=echo_err))


def show_baseline(baseline) -> None:
    """--compare: the unsteered reply, printed before the steered one starts streaming."""
    click.echo(f"[unsteered: {baseline.text!r}]", err=True)


def show(result) -> None:
    click.echo("")
    n_off = sum(map(len, result.steering.deactivate.values()))
    n_on = sum(map(len, result.steering.activate.values()))
    click.echo(f"[steered ({result.steering.scheme}): {n_off} experts masked, {n_on} boosted] "
               f"{result.generation.stats_line()}", err=True)
