"""The ``/v1/reap/*`` routes and the checks on completion bodies (what mlx-lm would otherwise choke on).

Each route takes the handler (for ``send_json`` and ``app``) and raises ``HTTPError`` for a bad request. Paths a
request names (``save``'s ``path``, ``safety_map``, ``domain_map``) must resolve — symlinks followed — inside the
server's ``--data-dir``, else 403.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from ..saliency import ARRAY_KEYS, METRICS

STEER_KEYS = ("safety_map", "domain_map", "mode", "safety_mode", "domain_mode", "deactivate", "activate",
              "mask_value", "boost_value", "scheme")


def _error(*args):
    from .handler import HTTPError

    return HTTPError(*args)


# ------------------------------------------------------------------------------------------ completions
def check_completion(handler, path: str, body: dict) -> dict:
    """Refuse what mlx-lm's loop would fail on (or load from disk); name the served model. Returns the body."""
    app = handler.app
    model = body.get("model", "default_model")
    if not isinstance(model, str) or model not in app.aliases:
        raise _error(404, f"model {model!r} is not served here; this server serves {app.model_id!r} "
                          "(GET /v1/models).", "model")
    for key in ("adapters", "draft_model"):
        if body.get(key) is not None:
            raise _error(400, f"{key} is not supported by mlx-fun serve (a request may not load files); "
                              "remove it.", key)
    body["model"] = app.model_id
    if path.endswith("chat/completions"):
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _error(400, "messages must be a non-empty list of {\"role\", \"content\"} objects.", "messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _error(400, f"messages[{i}] must be an object with a string \"role\".", f"messages[{i}]")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise _error(400, "prompt must be a non-empty string.", "prompt")
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict) and isinstance(opts.get("include_usage"), bool)):
        raise _error(400, "stream_options must be {\"include_usage\": true|false}.", "stream_options")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _error(400, "stop must be a string or a list of strings.", "stop")
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise _error(400, "logit_bias must be an object mapping token ids to numbers.", "logit_bias")
        for k, v in bias.items():
            if not str(k).isdigit() or int(k) >= app.vocab_size or isinstance(v, bool) or \
                    not isinstance(v, (int, float)):
                raise _error(400, f"logit_bias entry {k!r}: keys are token ids 0..{app.vocab_size - 1}, values "
                                  "numbers.", "logit_bias")
    return body


# ------------------------------------------------------------------------------------------ GET
def get(handler, path: str) -> None:
    app = handler.app
    if path == "/v1/reap/stats":
        return handler.send_json(200, stats(app))
    if path == "/v1/reap/info":
        return handler.send_json(200, app.info())
    if path == "/v1/reap/steer":
        return handler.send_json(200, steer_state(app))
    raise _error(404, f"no route GET {path}; REAP routes: /v1/reap/stats, /v1/reap/info, /v1/reap/steer.")


def stats(app) -> dict:
    counter = app.counter_or_503()
    synced = counter.sync(app.generation_alive)
    acc, totals = counter.snapshot()
    out = {key: getattr(acc, key).tolist() for key in ARRAY_KEYS}
    out.update(
        model_type=acc.model_type, num_layers=acc.num_layers, num_experts=acc.num_experts, top_k=acc.top_k,
        moe_layer_indices=acc.moe_layer_indices, mode=app.mode, **totals,
        total_samples=totals["token_count"], synced=synced,
        computed_scores={m: acc.scores(m).tolist() for m in METRICS},
    )
    return out


def steer_state(app) -> dict:
    s = app.generator.steering
    return {"active": s is not None, "steering": None if s is None else s.to_json()}


# ------------------------------------------------------------------------------------------ POST / DELETE
def post(handler, path: str, body: dict) -> None:
    app = handler.app
    if path == "/v1/reap/save":
        return handler.send_json(200, save(app, body))
    if path == "/v1/reap/reset":
        counter = app.counter_or_503()
        counter.sync(app.generation_alive)
        before = counter.reset()
        return handler.send_json(200, {"reset": True, "before": before})
    if path == "/v1/reap/steer":
        return handler.send_json(200, post_steer(app, body))
    raise _error(404, f"no route POST {path}; REAP routes: /v1/reap/save, /v1/reap/reset, /v1/reap/steer.")


def delete_steer(handler) -> None:
    app = handler.app
    counter = app.counter_or_503()
    app.generator.post_steering(None)
    applied = counter.sync(app.generation_alive)
    handler.send_json(200, {"active": False, "steering": None, "applied": applied})


def confined(app, value, field: str) -> Path:
    """``value`` as a path inside the data directory (relative paths are relative to it), else 403."""
    if not isinstance(value, str) or not value.strip() or "\x00" in value:
        raise _error(400, f"{field} must be a non-empty path string.", field)
    root = app.data_dir
    p = Path(value).expanduser()
    resolved = (p if p.is_absolute() else root / p).resolve()
    if not resolved.is_relative_to(root):
        raise _error(403, f"{field} {value!r} resolves outside the server's data directory {root} (--data-dir); "
                          "name a path inside it.", field)
    return resolved


def save(app, body: dict) -> dict:
    unknown = sorted(set(body) - {"path"})
    if unknown:
        raise _error(400, f"unknown field {unknown[0]!r}; save takes {{\"path\": \"<file>.npz\"}}.", unknown[0])
    if "path" not in body:
        raise _error(400, "path is required: {\"path\": \"<file>.npz\"} (inside --data-dir).", "path")
    path = confined(app, body["path"], "path")
    if path.suffix != ".npz":
        raise _error(400, f"path {body['path']!r} must end in .npz (the format prune --saliency reads).", "path")
    counter = app.counter_or_503()
    synced = counter.sync(app.generation_alive)
    acc, totals = counter.snapshot()
    try:
        acc.save(path, inputs={"--model": app.model_path})
    except UserError as e:
        raise _error(400, str(e), "path") from None
    return {"path": str(path), "synced": synced, **totals}


def post_steer(app, body: dict) -> dict:
    from ..steering import SteeringError, for_adapter

    counter = app.counter_or_503()
    unknown = sorted(set(body) - set(STEER_KEYS))
    if unknown:
        raise _error(400, f"unknown field {unknown[0]!r}; steering takes {', '.join(STEER_KEYS)}.", unknown[0])
    kw = {k: body[k] for k in ("deactivate", "activate", "mask_value", "boost_value", "scheme") if k in body}
    safety_mode, domain_mode = body.get("safety_mode"), body.get("domain_mode")
    if "mode" in body:
        if ("safety_map" in body) == ("domain_map" in body):
            raise _error(400, "mode goes with exactly one of safety_map / domain_map; with both, use safety_mode "
                              "and domain_mode.", "mode")
        if "safety_map" in body:
            safety_mode = body["mode"]
        else:
            domain_mode = body["mode"]
    names = {"safety_mode": "mode" if "mode" in body and "safety_map" in body else "safety_mode",
             "domain_mode": "mode" if "mode" in body and "domain_map" in body else "domain_mode"}
    paths = {k: confined(app, body[k], k) for k in ("safety_map", "domain_map") if k in body}
    if not paths and not kw.keys() & {"deactivate", "activate"}:
        raise _error(400, "nothing to steer: give safety_map, domain_map, deactivate or activate "
                          "(DELETE /v1/reap/steer removes steering).")
    try:
        steering = for_adapter(counter.adapter, safety_map=paths.get("safety_map"), safety_mode=safety_mode,
                               domain_map=paths.get("domain_map"), domain_mode=domain_mode, field_names=names, **kw)
    except SteeringError as e:
        raise _error(400, str(e), e.field) from None
    except UserError as e:
        raise _error(400, str(e)) from None
    app.generator.post_steering(steering)
    applied = counter.sync(app.generation_alive)
    return {"active": not steering.empty, "steering": steering.to_json(), "applied": applied}
