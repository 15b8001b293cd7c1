"""Dashboard: where live traffic has been routed — heatmap, one layer's bars, experts without traffic.

While the tab's auto-refresh is on, a timer asks the server for its totals (``GET /v1/reap/info``) every
:data:`REFRESH_S` seconds and redraws (``GET /v1/reap/stats``) only when tokens were counted since the last
drawing: figures follow traffic while it flows and cost nothing while it does not.
"""

from __future__ import annotations

import numpy as np

from ..common import METRICS, Context, guarded

REFRESH_S = 2.0


def view(stats: dict, metric: str) -> tuple[np.ndarray, list[int], str]:
    """``(scores (MoE layers, experts), decoder index per row, summary)`` from ``GET /v1/reap/stats``."""
    scores = np.asarray(stats["computed_scores"][metric], dtype=np.float64)
    freq = np.asarray(stats["freq"], dtype=np.float64)
    layers = [int(i) for i in stats["moe_layer_indices"]]
    idle_pairs = int((freq == 0).sum())
    idle_everywhere = int((freq == 0).all(axis=0).sum())
    n = int(stats["request_count"])
    text = (f"**{int(stats['token_count']):,} tokens** counted in {n:,} request{'' if n == 1 else 's'} · "
            f"{len(layers)} MoE layers × {freq.shape[1]} experts, top-{int(stats['top_k'])} · "
            f"**{idle_pairs} of {freq.size} (layer, expert) pairs received no traffic**; "
            f"{idle_everywhere} experts received none in any layer · counting mode {stats.get('mode', '?')}")
    if metric in ("reap", "ean") and stats.get("mode") == "lightweight":
        text += " · ⚠️ REAP / EAN need output norms: start the server with `--mode full`"
    return scores, layers, text


def traffic(answer: dict) -> tuple[int, int]:
    """What changes when traffic flows (or the counters are reset): the totals in ``GET /v1/reap/info`` (and
    ``/stats``)."""
    return int(answer["token_count"]), int(answer["request_count"])


def draw(stats: dict, metric: str, chosen) -> tuple:
    """``(summary, heatmap, bars, layer choices update value, decoder layer shown)``."""
    from ..plots import heatmap, layer_bars

    scores, layers, text = view(stats, metric)
    layer = int(chosen) if chosen not in (None, "") and int(chosen) in layers else layers[0]
    return (text, heatmap(scores, metric=metric, layer_names=layers),
            layer_bars(scores[layers.index(layer)], metric=metric, layer=layer), layers, layer)


def build(ctx: Context) -> None:
    import gradio as gr

    with gr.Row():
        metric = gr.Radio(METRICS, value="freq", label="Metric", elem_id="dashboard-metric", scale=3)
        layer = gr.Dropdown(choices=[], label="Layer (bar chart)", elem_id="dashboard-layer", scale=1)
        auto = gr.Checkbox(value=True, label=f"Auto-refresh while traffic flows ({REFRESH_S:g} s)", scale=1)
        refresh = gr.Button("Refresh", scale=1, elem_id="dashboard-refresh")
    summary = gr.Markdown(elem_id="dashboard-summary")
    status = gr.Markdown(elem_id="dashboard-status")
    heat = gr.Plot(label="Expert heatmap (layers × experts)", format="png", elem_id="dashboard-heatmap")
    bars = gr.Plot(label="One layer's experts", format="png", elem_id="dashboard-bars")
    seen = gr.State(None)  # the totals drawn last, so the timer redraws only after new traffic
    timer = gr.Timer(REFRESH_S, active=True)

    @guarded(6, 4)
    def redraw(m, chosen):
        stats = ctx.client.stats()
        text, hfig, bfig, layers, shown = draw(stats, m, chosen)
        return text, hfig, bfig, gr.update(choices=layers, value=shown), "", traffic(stats)

    @guarded(6, 4)
    def tick(m, chosen, last):
        totals = traffic(ctx.client.info())
        if last is not None and tuple(last) == totals:
            return gr.update(), gr.update(), gr.update(), gr.update(), "", gr.update()
        return redraw.__wrapped__(m, chosen)

    outs = [summary, heat, bars, layer, status, seen]
    for trigger in (refresh.click, metric.change, layer.input):
        trigger(redraw, [metric, layer], outs)
    timer.tick(tick, [metric, layer, seen], outs, show_progress="hidden", concurrency_limit=1,
               trigger_mode="always_last")
    auto.change(lambda on: gr.Timer(active=on), auto, timer)
