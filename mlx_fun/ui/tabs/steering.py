"""Steering: apply a safety / domain report or a custom JSON config to the server, see what is active (a layer ×
expert map of the masked and boosted experts, :func:`effects`; the server's JSON below it), remove it.

Report paths are the *server's* (inside its ``--data-dir``): the server reads the report with the same
functions ``mlx-fun steer`` uses (:func:`mlx_fun.experts.steering.for_adapter`) and checks the request as it checks any
REST client's.
"""

from __future__ import annotations

from ...errors import UserError
from ...experts.steer_options import SCHEME, SCHEME_DEFAULT
from ..common import Context, guarded

#: a report kind's modes (``POST /v1/reap/steer`` ``mode``), the first one the default
MODES = {"safety": ["unsafe", "safe"], "domain": ["boost", "suppress"]}
SCHEMES = list(SCHEME.type.choices)  # the CLI's choice, in its order
EXAMPLE = '{"deactivate": {"0": [1, 2]}, "activate": {"1": [3]}, "scheme": "additive"}'
#: what steering does to an expert, with its colour on the map
EFFECTS = (("routed as trained", "#dddddd"), ("masked", "#d1495b"), ("boosted", "#2a9d8f"))


def report_body(kind: str, path: str, mode: str, scheme: str) -> dict:
    """The ``POST /v1/reap/steer`` body for a report."""
    if kind not in MODES:
        raise UserError(f"the report kind must be safety or domain, got {kind!r}.")
    if not path or not path.strip():
        raise UserError(f"give the {kind} report's path (inside the server's --data-dir), e.g. {kind}_report.json.")
    if mode not in MODES[kind]:
        raise UserError(f"a {kind} report steers in mode {' or '.join(MODES[kind])}, not {mode!r}.")
    if scheme not in SCHEMES:
        raise UserError(f"the scheme must be additive or rank, got {scheme!r}.")
    return {f"{kind}_map": path.strip(), "mode": mode, "scheme": scheme}


def custom_body(text: str) -> dict:
    """A custom steering config typed as JSON (the REST body), checked to be an object; the server checks the
    rest (layers, experts, fields) and answers one line."""
    from ...core.json_input import parse

    return parse(text or "", "the custom steering", fix=f"e.g. {EXAMPLE}", expect=dict)


def describe(state: dict) -> str:
    """One paragraph for the state ``GET|POST|DELETE /v1/reap/steer`` answer."""
    s = state.get("steering")
    if not state.get("active") or not s:
        return "**No steering is active**: the model routes as trained."
    off, on = s.get("deactivate") or {}, s.get("activate") or {}
    text = (f"**Steering active** ({s.get('scheme')} scheme): {sum(map(len, off.values()))} experts masked in "
            f"{len(off)} layers, {sum(map(len, on.values()))} boosted in {len(on)} layers")
    sources = [f"{x.get('kind')} report {x.get('report')} ({x.get('mode')})" for x in s.get("sources") or []]
    text += f"; from {', '.join(sources)}." if sources else "."
    return text + "".join(f"\n\n⚠️ {w}" for w in s.get("warnings") or [])


def effects(state: dict, info: dict):
    """``(codes, decoder layer per row)``: each expert of the served model (``info``: ``GET /v1/reap/info``) as an
    index into :data:`EFFECTS` under the steering ``state``; None when none is active."""
    import numpy as np

    s = state.get("steering")
    if not state.get("active") or not s:
        return None
    layers = [int(i) for i in info["moe_layer_indices"]]
    codes = np.zeros((len(layers), int(info["num_experts"])), dtype=np.int64)
    for key, code in (("deactivate", 1), ("activate", 2)):
        for layer, experts in (s.get(key) or {}).items():
            codes[layers.index(int(layer)), list(experts)] = code
    return codes, layers


def effects_map(state: dict, info: dict):
    """The map of :func:`effects` (None, no figure, when no steering is active)."""
    from ..plots import status_heatmap

    found = effects(state, info)
    if found is None:
        return None
    codes, layers = found
    masked, boosted = int((codes == 1).sum()), int((codes == 2).sum())
    return status_heatmap(codes, categories=EFFECTS, layer_names=layers,
                          title=f"Steering: {masked} masked and {boosted} boosted experts, per layer")


def build(ctx: Context) -> None:
    import gradio as gr

    with gr.Row():
        with gr.Column():
            gr.Markdown("### From a report")
            kind = gr.Radio(list(MODES), value="safety", label="Report kind (safety-scan / domain-scan)",
                            elem_id="steer-kind")
            path = gr.Textbox(label="Report path (on the server, inside its --data-dir)",
                              placeholder="safety_report.json", elem_id="steer-path")
            mode = gr.Radio(MODES["safety"], value="unsafe", label="Mode", elem_id="steer-mode")
            scheme = gr.Radio(SCHEMES, value=SCHEME_DEFAULT, label="Scheme")
            apply_report = gr.Button("Apply report", variant="primary", elem_id="steer-apply-report")
        with gr.Column():
            gr.Markdown("### Custom JSON")
            custom = gr.Code(value=EXAMPLE, language="json", label="Steering config (the REST body)",
                             elem_id="steer-custom")
            apply_custom = gr.Button("Apply JSON", variant="primary", elem_id="steer-apply-json")
    with gr.Row():
        show = gr.Button("Show active steering", elem_id="steer-show")
        remove = gr.Button("Remove steering", variant="stop", elem_id="steer-remove")
    status = gr.Markdown(elem_id="steer-status")
    state_text = gr.Markdown(elem_id="steer-state")
    state_map = gr.Plot(label="Masked and boosted experts (layer × expert)", format="png", elem_id="steer-heatmap")
    state_json = gr.JSON(label="Active steering (as the server holds it)", open=False)

    def shown(state):
        return describe(state), effects_map(state, ctx.client.info()), state, ""

    kind.change(lambda k: gr.update(choices=MODES[k], value=MODES[k][0]), kind, mode)
    outs = [state_text, state_map, state_json, status]
    apply_report.click(guarded(4, 3)(lambda k, p, m, s: shown(ctx.client.steer(report_body(k, p, m, s)))),
                       [kind, path, mode, scheme], outs)
    apply_custom.click(guarded(4, 3)(lambda t: shown(ctx.client.steer(custom_body(t)))), custom, outs)
    show.click(guarded(4, 3)(lambda: shown(ctx.client.steering())), None, outs)
    remove.click(guarded(4, 3)(lambda: shown(ctx.client.unsteer())), None, outs)
