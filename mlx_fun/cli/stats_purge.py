"""``mlx-fun stats-purge``: parses, calls :func:`mlx_fun.jobs.stats_purge.run`, prints."""

from __future__ import annotations

import click

from ..jobs import stats_purge
from .common import echo_warnings, fmt_number, friendly_errors, text_table
from .options import job_kwargs, job_options


@click.command(
    "stats-purge",
    short_help="Zero out experts with too little activation evidence.",
)
@job_options(stats_purge.run)
@friendly_errors
def command(**kwargs):
    """Zero out (layer, expert) entries with minimal activation in a saliency file.

    Entries with freq < --min-freq or reap_count < --min-count get every statistic set to 0 (they score 0
    and rank last); the file keeps its dimensions. --max-norm only reports entries whose
    max_activation_norm exceeds it. At least one filter is required.

    \b
    Example:
      mlx-fun stats-purge --input runs/merged.npz --output runs/purged.npz --min-freq 100 --min-count 10
    """
    kwargs = job_kwargs(stats_purge.run, kwargs)
    show(stats_purge.run(**kwargs), **kwargs)


def show(report: dict, *, input, output, min_freq=None, min_count=None, max_norm=None, force=False) -> None:
    input_path = input
    by = report["by_filter"]
    click.echo(f"{input_path}: {report['total']} expert-layer pairs, {report['purged']} purged, "
               f"{report['kept']} kept -> {output}")
    rows = []
    if min_freq is not None:
        rows.append([f"freq < {fmt_number(min_freq)}", str(by["freq"]), "zeroed"])
    if min_count is not None:
        rows.append([f"reap_count < {fmt_number(min_count)}", str(by["count"]), "zeroed"])
    if max_norm is not None:
        rows.append([f"max_activation_norm > {fmt_number(max_norm)}", str(by["norm_over"]), "reported only"])
    click.echo(text_table(["filter", "entries", "action"], rows, align="lrl"))
    if min_freq is not None and min_count is not None:
        click.echo("  (an entry caught by both zeroing filters is counted under each, and once in 'purged')")
    over = report["norm_over_entries"]
    if over:
        click.echo("Entries over --max-norm" + (f" (first 10 of {len(over)})" if len(over) > 10 else "") + ":")
        click.echo(text_table(["layer", "moe_layer", "expert", "max_norm"],
                          [[str(e["layer"]), str(e["moe_layer"]), str(e["expert"]),
                            fmt_number(e["max_activation_norm"])] for e in over[:10]]))
    if report["layers_fully_purged"]:
        echo_warnings([f"every expert of MoE layer position(s) {report['layers_fully_purged']} was purged; "
               "lower the thresholds or collect more data."])
