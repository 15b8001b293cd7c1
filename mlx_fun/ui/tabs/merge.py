"""Merge Mode Comparison: rank-merge 2–4 saliency files, filter by rank sum, choose experts to prune or merge,
export ``filtered_experts.json`` / ``.csv`` for ``prune`` / ``merge --expert-list`` (:mod:`mlx_fun.ui.analysis`).
Two maps of layer × expert: the rank sums, and what happens to each expert (:func:`status_map`)."""

from __future__ import annotations

from ..analysis import STATUSES, Comparison, compare, export
from ..common import METRICS, Context, guarded

ACTIONS = [("Analyze", "analyze"), ("Prune", "prune"), ("Merge", "merge")]
SCOPES = [("Per layer", False), ("Model-wide (same experts in every layer)", True)]


def threshold(value) -> float | None:
    """A rank-sum filter box: empty or 0 is off."""
    return None if value in (None, "") or float(value) <= 0 else float(value)


#: each status's colour on the map (grey: kept as it is; blue: protected; orange: targeted but kept; reds: removed)
STATUS_COLOURS = {"keep": "#dddddd", "keep (protected)": "#4c72b0", "keep (targeted)": "#f2b880",
                  "remove": "#d1495b", "remove (targeted)": "#7a0f1f"}


def status_map(c: Comparison):
    """The layer × expert map of what the comparison does with each expert (the table's status column)."""
    from ..plots import status_heatmap

    verb = {"merge": "merged away", "prune": "pruned", "analyze": "removed"}[c.action]
    n = sum(len(v) for v in c.removed.values())
    return status_heatmap(c.statuses(), categories=[(name, STATUS_COLOURS[name]) for name in STATUSES],
                          layer_names=c.moe_layer_indices, title=f"Experts {verb} (red): {n} in all")


def table(c: Comparison) -> tuple[list[str], list[list]]:
    return ["layer", "expert", "rank sum", *[f"rank in {f}" for f in c.files], "status"], c.rows()


def next_step(c: Comparison, path) -> str:
    """The status line after an export: where it is and the command that uses it."""
    if c.action == "merge":
        cmd = f"mlx-fun merge --model MODEL --expert-list {path} --dataset CALIBRATION --output merged"
    else:
        cmd = f"mlx-fun prune --model MODEL --expert-list {path} --output pruned"
    return f"Wrote {path} — use it with `{cmd}`."


def build(ctx: Context) -> None:
    import gradio as gr

    from ..plots import heatmap

    with gr.Row():
        files = gr.Dropdown(ctx.npz_files(), multiselect=True, allow_custom_value=True, max_choices=4,
                            label="Saliency files (2–4 .npz, in the UI's --data-dir)", elem_id="merge-files", scale=4)
        rescan = gr.Button("Rescan files", scale=1, elem_id="merge-rescan")
    with gr.Row():
        metric = gr.Radio(METRICS, value="reap", label="Metric", elem_id="merge-metric")
        scope = gr.Radio(SCOPES, value=False, label="Selection")
        action = gr.Radio(ACTIONS, value="prune", label="Mode")
    with gr.Row():
        n_prune = gr.Number(value=0, precision=0, minimum=0, label="N to prune (per layer, or model-wide)",
                            elem_id="merge-n")
        protect = gr.Number(value=0, label="Protect: rank sum ≤ (0: off)", elem_id="merge-protect")
        target = gr.Number(value=0, label="Remove first: rank sum ≥ (0: off)", elem_id="merge-target")
    run = gr.Button("Compare", variant="primary", elem_id="merge-run")
    status = gr.Markdown(elem_id="merge-status")
    summary = gr.Markdown(elem_id="merge-summary")
    plot = gr.Plot(label="Rank sum per layer and expert (lower = more important)", format="png",
                   elem_id="merge-heatmap")
    chosen = gr.Plot(label="What happens to each expert", format="png", elem_id="merge-status-map")
    experts = gr.Dataframe(label="Experts", wrap=False, max_height=320, interactive=False)
    with gr.Row():
        name = gr.Textbox(value="filtered_experts.json", label="Export as (inside --data-dir)",
                          elem_id="merge-export-name", scale=3)
        export_json = gr.Button("Export JSON for CLI", variant="primary", elem_id="merge-export-json", scale=1)
        export_csv = gr.Button("Export CSV", elem_id="merge-export-csv", scale=1)
    download = gr.File(label="Exported file", interactive=False, elem_id="merge-download")
    last = gr.State(None)

    @guarded(6, 5)
    def analyse(fs, m, wide, act, n, prot, targ):
        c = compare(root=ctx.data_dir, files=fs or [], metric=m, n_prune=int(n or 0), model_wide=bool(wide),
                    protect_max_rank_sum=threshold(prot), target_min_rank_sum=threshold(targ), action=act)
        headers, rows = table(c)
        text = c.summary() + "".join(f"\n\n⚠️ {w}" for w in c.warnings)
        fig = heatmap(c.rank_sum, metric="rank_sum", layer_names=c.moe_layer_indices, cmap="viridis_r",
                      from_zero=False, title=f"Rank sum of {m} over {len(c.files)} files (bright = important)")
        return text, fig, status_map(c), gr.update(value=rows, headers=headers), c, ""

    def save(suffix):
        @guarded(2, 1)
        def saved(c, filename):
            if c is None:
                return gr.update(), "Run Compare first."
            stem = (filename or "").strip() or "filtered_experts"
            stem = stem[: -len(stem.rsplit(".", 1)[-1]) - 1] if stem.lower().endswith((".json", ".csv")) else stem
            path = export(c, root=ctx.data_dir, name=stem + suffix)
            return str(path), next_step(c, path.relative_to(ctx.data_dir.resolve()))

        return saved

    run.click(analyse, [files, metric, scope, action, n_prune, protect, target],
              [summary, plot, chosen, experts, last, status])
    export_json.click(save(".json"), [last, name], [download, status])
    export_csv.click(save(".csv"), [last, name], [download, status])
    rescan.click(lambda: gr.update(choices=ctx.npz_files()), None, files)
