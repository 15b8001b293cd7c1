"""``mlx-fun ui``: parses, calls :func:`mlx_fun.jobs.ui.run`, prints."""

from __future__ import annotations

import click

from .common import FiniteFloat, echo_err, friendly_errors


@click.command("ui", short_help="Web dashboard for a running `mlx-fun serve` (chat, heatmaps, steering, exports).")
@click.option("--server-url", default="http://127.0.0.1:8080", show_default=True,
              help="The running `mlx-fun serve` (reached only over HTTP).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address the dashboard listens on. Anything but loopback exposes the server through it.")
@click.option("--port", type=click.IntRange(0, 65535), default=7860, show_default=True, help="Port (0: a free one).")
@click.option("--share", is_flag=True, default=False,
              help="Also publish a public gradio.live link: exposes the server to anyone with it (a warning is "
                   "printed).")
@click.option("--api-key", default=None, envvar="MLX_FUN_API_KEY", show_envvar=True,
              help="The server's API key (its --api-key), sent as a Bearer token.")
@click.option("--data-dir", type=click.Path(file_okay=False), default=".", show_default=True,
              help="Where the Merge and Diff tabs read .npz files and write their exports (nothing outside it).")
@click.option("--timeout", type=FiniteFloat(0.0, min_open=True), default=10.0, show_default=True,
              help="Seconds each call to the server may take (a chat stream may pause up to 120 s).")
@friendly_errors
def command(**kwargs):
    """Open a web dashboard (Gradio; pip install 'mlx-fun[ui]') for a running `mlx-fun serve`: Chat (streamed),
    Dashboard (expert heatmaps and per-layer bars of the live counts, experts without traffic), Steering (reports
    or custom JSON), Merge Mode Comparison (rank-merge 2-4 saliency files, export --expert-list files), Diff
    Analysis (the stats-diff report) and Controls (info, save, reset, raw stats). It reaches the model only over
    HTTP; when the server is down the page says so in one line and carries on once it is back.

    \b
    Example (with `mlx-fun serve --model data/tiny-moe-chat --port 8080 --mode full` running):
      mlx-fun ui --server-url http://127.0.0.1:8080 --port 7860
      # then open http://127.0.0.1:7860
    """
    from ..jobs import ui

    show(ui.run(**kwargs, log=echo_err))


def show(result) -> None:
    click.echo(f"Dashboard on {result.url} for {result.server_url} stopped after {result.seconds:.0f} s.")
