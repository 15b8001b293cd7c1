"""Diff Analysis: two saliency files, one metric — diverging heatmap (colours clipped at a percentile), statistics,
the ``stats-diff`` JSON report (computed, and exported, by the ``stats-diff`` job itself: the same numbers as
``mlx-fun stats-diff``)."""

from __future__ import annotations

from ..analysis import diff, inside
from ..common import METRICS, Context, guarded


def stats_text(report: dict) -> str:
    s, d = report["stats"], report["distribution"]
    lines = [f"**{report['metric']}: file 1 − file 2** over {d['total']} (layer, expert) pairs",
             f"mean {s['mean']:.6g} · std {s['std']:.6g} · min {s['min']:.6g} · max {s['max']:.6g}",
             f"file 1 higher: {d['positive']} · file 2 higher: {d['negative']} · equal: {d['zero']}"]
    for key, title in (("top_positive", "file 1 higher"), ("top_negative", "file 2 higher")):
        top = report[key][:5]
        if top:
            lines.append(f"most {title}: " + ", ".join(f"layer {e['moe_layer']} expert {e['expert']} "
                                                       f"({e['diff']:+.4g})" for e in top))
    lines += [f"⚠️ {w}" for w in report.get("warnings", [])]
    return "\n\n".join(lines)


def build(ctx: Context) -> None:
    import gradio as gr

    from ..plots import CLIP_PERCENTILE, diff_heatmap

    choices = ctx.npz_files()
    with gr.Row():
        f1 = gr.Dropdown(choices, allow_custom_value=True, label="File 1 (.npz, in --data-dir)", elem_id="diff-f1")
        f2 = gr.Dropdown(choices, allow_custom_value=True, label="File 2", elem_id="diff-f2")
        rescan = gr.Button("Rescan files", elem_id="diff-rescan")
    metric = gr.Radio(METRICS, value="reap", label="Metric", elem_id="diff-metric")
    run = gr.Button("Compare", variant="primary", elem_id="diff-run")
    status = gr.Markdown(elem_id="diff-status")
    stats = gr.Markdown(elem_id="diff-stats")
    plot = gr.Plot(label=f"Difference heatmap (red: file 1 higher, blue: file 2 higher; the colours end at the "
                         f"{CLIP_PERCENTILE:g}th percentile of |difference|: one outlier does not wash out the rest)",
                   format="png", elem_id="diff-heatmap")
    with gr.Row():
        name = gr.Textbox(value="diff_report.json", label="Export as (inside --data-dir)", elem_id="diff-export-name",
                          scale=3)
        save = gr.Button("Export JSON", elem_id="diff-export", scale=1)
    download = gr.File(label="Exported report", interactive=False, elem_id="diff-download")
    report = gr.JSON(label="Report (as stats-diff writes it)", open=False)
    last = gr.State(None)  # (file 1, file 2, metric) of the report shown

    @guarded(5, 3)
    def compare(a, b, m):
        r = diff(root=ctx.data_dir, file1=a or "", file2=b or "", metric=m)
        fig = diff_heatmap(r["diff"], metric=m, layer_names=r["moe_layer_indices"], labels=("file 1", "file 2"))
        return stats_text(r), fig, r, "", (a, b, m)

    @guarded(2, 1)
    def export(shown, filename):
        if not shown:
            return gr.update(), "Run Compare first."
        a, b, m = shown
        out = (filename or "").strip() or "diff_report.json"
        path = inside(ctx.data_dir, out, "export file")
        diff(root=ctx.data_dir, file1=a, file2=b, metric=m, output=out)
        return str(path), f"Wrote {out} (the report `mlx-fun stats-diff --output` writes)."

    run.click(compare, [f1, f2, metric], [stats, plot, report, status, last])
    save.click(export, [last, name], [download, status])
    rescan.click(lambda: [gr.update(choices=ctx.npz_files())] * 2, None, [f1, f2])
