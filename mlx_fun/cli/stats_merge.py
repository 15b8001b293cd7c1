"""``mlx-fun stats-merge``: parses, calls :func:`mlx_fun.jobs.stats_merge.run`, prints."""

from __future__ import annotations

import click

from ..jobs import stats_merge
from .common import echo_warnings, fmt_number, friendly_errors
from .options import job_kwargs, job_options


@click.command(
    "stats-merge",
    short_help="Rank-merge saliency files of several datasets into one.",
)
@job_options(stats_merge.run)
@friendly_errors
def command(**kwargs):
    """Combine saliency files of several datasets by rank aggregation.

    In every file each layer's experts are ranked by the metric (1 = highest score, num_experts = lowest,
    ties share their average rank) and the ranks are summed over the files: a lower rank sum means a more
    important expert, and every dataset counts equally whatever its sample count. Rank sums lie in
    [n, n*num_experts] for n files. The output also holds the summed raw statistics, and
    `prune --metric METRIC --saliency OUTPUT` drops the experts that ranked worst across the datasets.
    Merge all original files in one call: merging an already-merged file re-ranks it and weighs it as one
    dataset.

    \b
    Example:
      mlx-fun stats-merge --files runs/code.npz --files runs/prose.npz --output runs/merged.npz --metric reap
    """
    show(stats_merge.run(**job_kwargs(stats_merge.run, kwargs)))


def show(result) -> None:
    echo_warnings(result.warnings)
    merged, metric, output = result.merged, result.metric, result.output
    n, E = result.files, merged.num_experts
    rank_sum = merged.extra[f"rank_sum_{metric}"]
    click.echo(f"Merged {n} files by {metric} rank ({merged.num_layers} MoE layers x {E} experts) -> {output}")
    click.echo(f"  rank sums: observed {fmt_number(rank_sum.min())} .. {fmt_number(rank_sum.max())} "
               f"(possible range [{n}, {n * E}]; lower = more important)")
    click.echo(f"  prune with: mlx-fun prune --metric {metric} --saliency {output}")
