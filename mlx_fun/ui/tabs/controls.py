"""Controls: server info, save the counts to a file (on the server, inside its --data-dir), reset, raw stats."""

from __future__ import annotations

from ..common import Context, guarded


def saved_line(answer: dict) -> str:
    return (f"Saved the counts of {int(answer['token_count']):,} tokens to {answer['path']} (on the server): "
            "ready for `mlx-fun prune --saliency` and the Merge / Diff tabs.")


def reset_line(answer: dict) -> str:
    before = answer.get("before") or {}
    return f"Counters reset ({int(before.get('token_count', 0)):,} tokens were counted before)."


def build(ctx: Context) -> None:
    import gradio as gr

    with gr.Row():
        info = gr.Button("Server info", elem_id="controls-info")
        raw = gr.Button("Raw stats", elem_id="controls-raw")
        reset = gr.Button("Reset counters", variant="stop", elem_id="controls-reset")
    with gr.Row():
        path = gr.Textbox(value="saliency.npz", label="Save counts as (.npz, inside the server's --data-dir)",
                          elem_id="controls-save-path", scale=3)
        save = gr.Button("Save", variant="primary", elem_id="controls-save", scale=1)
    status = gr.Markdown(elem_id="controls-status")
    out = gr.JSON(label="Answer", elem_id="controls-answer")

    def answer(fn, line=lambda r: ""):
        @guarded(2, 1)
        def run(*args):
            r = fn(*args)
            return r, line(r)

        return run

    info.click(answer(ctx.client.info), None, [out, status])
    raw.click(answer(ctx.client.stats), None, [out, status])
    save.click(answer(ctx.client.save, saved_line), path, [out, status])
    reset.click(answer(ctx.client.reset, reset_line), None, [out, status])
