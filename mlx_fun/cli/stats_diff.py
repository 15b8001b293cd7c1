"""``mlx-fun stats-diff``: parses, calls :func:`mlx_fun.jobs.stats_diff.run`, prints."""

from __future__ import annotations

import click

from ..jobs import stats_diff
from .common import echo_warnings, fmt_number, friendly_errors, text_table
from .options import job_kwargs, job_options


@click.command(
    "stats-diff",
    short_help="Compare one saliency metric between two saliency files.",
)
@job_options(stats_diff.run)
@friendly_errors
def command(**kwargs):
    """Compare a saliency metric between two collected saliency files of the same model.

    Computes diff = score(file1) - score(file2) for every (layer, expert) and prints its statistics (mean,
    std, min, max), how many entries are positive (file1 > file2), negative or zero, and the 10 largest
    positive and negative differences. Use it to see how expert routing changes between datasets.

    \b
    Example:
      mlx-fun stats-diff --file1 runs/code.npz --file2 runs/prose.npz --metric freq --output runs/diff.json
    """
    show(stats_diff.run(**job_kwargs(stats_diff.run, kwargs)), kwargs["output"])


def show(report: dict, output=None) -> None:
    echo_warnings(report["warnings"])
    file1, file2, metric = report["file1"], report["file2"], report["metric"]
    st, dist = report["stats"], report["distribution"]
    click.echo(f"{metric} difference: {file1} - {file2}  "
               f"({report['num_layers']} MoE layers x {report['num_experts']} experts, {dist['total']} pairs)")
    click.echo(text_table(["mean", "std", "min", "max"], [[fmt_number(st[k]) for k in ("mean", "std", "min", "max")]]))
    click.echo(f"Distribution: {dist['positive']} positive (file1 > file2), {dist['negative']} negative "
               f"(file1 < file2), {dist['zero']} zero")
    headers = ["layer", "moe_layer", "expert", "diff", "file1", "file2"]
    for title, key in (("Top positive differences (file1 > file2):", "top_positive"),
                       ("Top negative differences (file1 < file2):", "top_negative")):
        entries = report[key]
        if not entries:
            click.echo(f"{title} none")
            continue
        click.echo(title)
        rows = [[str(e["layer"]), str(e["moe_layer"]), str(e["expert"]), fmt_number(e["diff"]), fmt_number(e["value1"]),
                 fmt_number(e["value2"])] for e in entries]
        click.echo(text_table(headers, rows))
    if output is not None:
        click.echo(f"Wrote report to {output}")
