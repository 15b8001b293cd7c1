"""stats-diff, stats-merge, stats-purge: compare, combine and clean saliency files written by ``collect``."""

from __future__ import annotations

import click

from .. import writer
from ..errors import UserError
from .common import FiniteFloat, friendly_errors, metric_option


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _table(headers: list[str], rows: list[list[str]], indent: str = "  ", align: str = "") -> str:
    """Aligned text table; ``align`` has one 'l' or 'r' per column (missing: right-aligned, for numbers)."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells):
        return indent + "  ".join(c.ljust(w) if align[i:i + 1] == "l" else c.rjust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in rows])


def _warn(messages: list[str]) -> None:
    for msg in messages:
        click.echo(f"Warning: {msg}", err=True)


# --------------------------------------------------------------------------------------------- stats-diff
@click.command(
    "stats-diff",
    short_help="Compare one saliency metric between two saliency files.",
)
@click.option("--file1", required=True, type=click.Path(), help="First saliency .npz (from `mlx-fun collect`).")
@click.option("--file2", required=True, type=click.Path(), help="Second saliency .npz of the same model.")
@metric_option()
@click.option("--output", type=click.Path(), default=None,
              help="Also write the full report (stats, top lists, whole diff matrix) as JSON here.")
@friendly_errors
def stats_diff(file1, file2, metric, output):
    """Compare a saliency metric between two collected saliency files of the same model.

    Computes diff = score(file1) - score(file2) for every (layer, expert) and prints its statistics (mean,
    std, min, max), how many entries are positive (file1 > file2), negative or zero, and the 10 largest
    positive and negative differences. Use it to see how expert routing changes between datasets.

    \b
    Example:
      mlx-fun stats-diff --file1 code.npz --file2 prose.npz --metric freq --output diff.json
    """
    from ..saliency import SaliencyAccumulator
    from ..stats import diff

    if output is not None:
        writer.check_output_path(output, kind="file", inputs={"--file1": file1, "--file2": file2})
    a, b = SaliencyAccumulator.load(file1), SaliencyAccumulator.load(file2)
    report = diff(a, b, metric, labels=(file1, file2))
    report = {"file1": str(file1), "file2": str(file2), **report}
    _warn(report["warnings"])

    st, dist = report["stats"], report["distribution"]
    click.echo(f"{metric} difference: {file1} - {file2}  "
               f"({report['num_layers']} MoE layers x {report['num_experts']} experts, {dist['total']} pairs)")
    click.echo(_table(["mean", "std", "min", "max"], [[_fmt(st[k]) for k in ("mean", "std", "min", "max")]]))
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
        rows = [[str(e["layer"]), str(e["moe_layer"]), str(e["expert"]), _fmt(e["diff"]), _fmt(e["value1"]),
                 _fmt(e["value2"])] for e in entries]
        click.echo(_table(headers, rows))
    if output is not None:
        writer.write_json(output, report, inputs={"--file1": file1, "--file2": file2})
        click.echo(f"Wrote report to {output}")


# --------------------------------------------------------------------------------------------- stats-merge
@click.command(
    "stats-merge",
    short_help="Rank-merge saliency files of several datasets into one.",
)
@click.option("--files", "files", required=True, multiple=True, type=click.Path(),
              help="Saliency .npz to merge; repeat for each file (at least 2, same model).")
@click.option("--output", required=True, type=click.Path(), help="Merged saliency .npz to write.")
@metric_option()
@friendly_errors
def stats_merge(files, output, metric):
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
      mlx-fun stats-merge --files code.npz --files prose.npz --output merged.npz --metric reap
    """
    from ..saliency import SaliencyAccumulator
    from ..stats import merge_warnings, rank_merge

    files = list(files)
    writer.check_output_path(output, kind="file", inputs={"--files": files})
    if len(files) < 2:
        raise UserError(f"stats-merge needs at least 2 saliency files, got {len(files)}; repeat --files.")
    accs = [SaliencyAccumulator.load(f) for f in files]
    _warn(merge_warnings(accs, metric, files))
    merged = rank_merge(accs, metric, labels=files)
    merged.save(output, inputs={"--files": files})

    n, E = len(files), merged.num_experts
    rank_sum = merged.extra[f"rank_sum_{metric}"]
    click.echo(f"Merged {n} files by {metric} rank ({merged.num_layers} MoE layers x {E} experts) -> {output}")
    click.echo(f"  rank sums: observed {_fmt(rank_sum.min())} .. {_fmt(rank_sum.max())} "
               f"(possible range [{n}, {n * E}]; lower = more important)")
    click.echo(f"  prune with: mlx-fun prune --metric {metric} --saliency {output}")


# --------------------------------------------------------------------------------------------- stats-purge
@click.command(
    "stats-purge",
    short_help="Zero out experts with too little activation evidence.",
)
@click.option("--input", "input_path", required=True, type=click.Path(), help="Saliency .npz to clean.")
@click.option("--output", required=True, type=click.Path(), help="Purged saliency .npz to write (same shape).")
@click.option("--min-freq", type=FiniteFloat(min=0), default=None,
              help="Zero out entries routed fewer than this many times (freq < MIN_FREQ).")
@click.option("--min-count", type=FiniteFloat(min=0), default=None,
              help="Zero out entries with fewer than this many output-norm samples (reap_count < MIN_COUNT).")
@click.option("--max-norm", type=FiniteFloat(min=0), default=None,
              help="Only report entries whose max activation norm exceeds this; nothing is capped or zeroed.")
@friendly_errors
def stats_purge(input_path, output, min_freq, min_count, max_norm):
    """Zero out (layer, expert) entries with minimal activation in a saliency file.

    Entries with freq < --min-freq or reap_count < --min-count get every statistic set to 0 (they score 0
    and rank last); the file keeps its dimensions. --max-norm only reports entries whose
    max_activation_norm exceeds it. At least one filter is required.

    \b
    Example:
      mlx-fun stats-purge --input merged.npz --output purged.npz --min-freq 100 --min-count 10
    """
    from ..saliency import SaliencyAccumulator
    from ..stats import purge

    if min_freq is None and min_count is None and max_norm is None:
        raise UserError("stats-purge needs at least one filter: --min-freq, --min-count or --max-norm.")
    writer.check_output_path(output, kind="file", inputs={"--input": input_path})
    acc = SaliencyAccumulator.load(input_path)
    purged, report = purge(acc, min_freq=min_freq, min_count=min_count, max_norm=max_norm)
    purged.save(output, inputs={"--input": input_path})

    by = report["by_filter"]
    click.echo(f"{input_path}: {report['total']} expert-layer pairs, {report['purged']} purged, "
               f"{report['kept']} kept -> {output}")
    rows = []
    if min_freq is not None:
        rows.append([f"freq < {_fmt(min_freq)}", str(by["freq"]), "zeroed"])
    if min_count is not None:
        rows.append([f"reap_count < {_fmt(min_count)}", str(by["count"]), "zeroed"])
    if max_norm is not None:
        rows.append([f"max_activation_norm > {_fmt(max_norm)}", str(by["norm_over"]), "reported only"])
    click.echo(_table(["filter", "entries", "action"], rows, align="lrl"))
    if min_freq is not None and min_count is not None:
        click.echo("  (an entry caught by both zeroing filters is counted under each, and once in 'purged')")
    over = report["norm_over_entries"]
    if over:
        click.echo("Entries over --max-norm" + (f" (first 10 of {len(over)})" if len(over) > 10 else "") + ":")
        click.echo(_table(["layer", "moe_layer", "expert", "max_norm"],
                          [[str(e["layer"]), str(e["moe_layer"]), str(e["expert"]),
                            _fmt(e["max_activation_norm"])] for e in over[:10]]))
    if report["layers_fully_purged"]:
        _warn([f"every expert of MoE layer position(s) {report['layers_fully_purged']} was purged; "
               "lower the thresholds or collect more data."])


COMMANDS = [stats_diff, stats_merge, stats_purge]
