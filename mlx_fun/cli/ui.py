"""``mlx-fun ui``: parses, calls :func:`mlx_fun.jobs.ui.run`, prints."""

from __future__ import annotations

import click

from ..jobs import ui
from .common import echo_err, friendly_errors
from .options import job_kwargs, job_options


@click.command("ui", short_help="Web dashboard for a running `mlx-fun serve` (chat, heatmaps, steering, exports).")
@job_options(ui.run)
@friendly_errors
def command(**kwargs):
    """Open a web dashboard (Gradio; pip install 'mlx-fun[ui]') for a running `mlx-fun serve`: Chat (streamed),
    Dashboard (expert heatmaps and per-layer bars of the live counts, experts without traffic), Steering (reports
    or custom JSON), Merge Mode Comparison (rank-merge 2-4 saliency files, export --expert-list files), Diff
    Analysis (the stats-diff report) and Controls (info, save, reset, raw stats). It reaches the model only over
    HTTP; when the server is down the page says so in one line and carries on once it is back.

    \b
    Example (with `mlx-fun serve --model data/tiny-moe-chat --port 8080 --mode full --data-dir runs` running):
      mlx-fun ui --server-url http://127.0.0.1:8080 --port 7860 --data-dir runs
      # then open http://127.0.0.1:7860
    """
    show(ui.run(**job_kwargs(ui.run, kwargs), log=echo_err))


def show(result) -> None:
    click.echo(f"Dashboard on {result.url} for {result.server_url} stopped after {result.seconds:.0f} s.")
