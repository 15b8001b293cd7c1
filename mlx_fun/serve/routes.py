"""The ``/v1/reap/*`` routes and the checks on completion bodies (what mlx-lm would otherwise choke on).

Each route takes the handler (for ``send_json`` and ``app``) and raises ``HTTPError`` for a bad request. Paths a
request names (``save``'s ``path``, ``safety_map``, ``domain_map``) must resolve — symlinks followed — inside the
server's ``--data-dir``, else 403.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from ..errors import UserError
from ..observe.saliency import ARRAY_KEYS, METRICS
from .errors import HTTPError
from .params import check_numbers

STEER_KEYS = ("safety_map", "domain_map", "mode", "safety_mode", "domain_mode", "deactivate", "activate",
              "mask_value", "boost_value", "scheme", "boost_experts")


# ------------------------------------------------------------------------------------------ completions
def check_completion(handler, path: str, body: dict) -> dict:
    """Refuse what mlx-lm's loop would fail on (or load from disk); name the served model. Returns the body."""
    app = handler.app
    model = body.get("model", "default_model")
    if not isinstance(model, str) or model not in app.aliases:
        raise HTTPError(404, f"model {model!r} is not served here; this server serves {app.model_id!r} "
                          "(GET /v1/models).", "model")
    for key in ("adapters", "draft_model"):
        if body.get(key) is not None:
            raise HTTPError(400, f"{key} is not supported by mlx-fun serve (a request may not load files); "
                              "remove it.", key)
    _check_unsupported(body)
    body["model"] = app.model_id
    if path.endswith("chat/completions"):
        _check_messages(body.get("messages"))
        _check_template_kwargs(body.get("chat_template_kwargs"))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise HTTPError(400, "prompt must be a non-empty string.", "prompt")
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict) and isinstance(opts.get("include_usage"), bool)):
        raise HTTPError(400, "stream_options must be {\"include_usage\": true|false}.", "stream_options")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise HTTPError(400, "stop must be a string or a list of strings.", "stop")
    check_numbers(body, max_tokens_limit=app.max_tokens_limit, context=app.context, vocab_size=app.vocab_size)
    return body


#: OpenAI fields mlx-lm's server does not read although they change the answer: ``{field: (the values that change
#: nothing, what to do instead)}`` — any other value is a 400 rather than an answer that silently ignores it
UNSUPPORTED = {
    "n": ((None, 1), "one choice per request: send n 1 (or none) and repeat the request for more"),
    "best_of": ((None, 1), "one candidate per request: send best_of 1 (or none)"),
    "echo": ((None, False), "the prompt is not echoed: send echo false (or none)"),
    "suffix": ((None, ""), "insertion is not served: send the text before the gap as the prompt only"),
    "response_format": ((None, {"type": "text"}), "structured output is not served: ask for it in the prompt"),
}


def _check_unsupported(body: dict) -> None:
    for key, (inert, fix) in UNSUPPORTED.items():
        value = body.get(key)
        if not any(value == v and type(value) is type(v) for v in inert):
            shown = json.dumps(value)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise HTTPError(400, f"{key} {shown} is not supported by mlx-fun serve ({fix}).", key)


def _check_messages(msgs) -> None:
    """A non-empty list of ``{"role": str, "content": str | null | [{"type": "text", "text": str}, ...]}``: the
    text mlx-lm serves (image parts would have its handler fetch URLs; it serves no images here)."""
    if not isinstance(msgs, list) or not msgs:
        raise HTTPError(400, "messages must be a non-empty list of {\"role\", \"content\"} objects.", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise HTTPError(400, f"messages[{i}] must be an object with a string \"role\".", f"messages[{i}]")
        content = m.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list) or not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise HTTPError(400, f"messages[{i}].content must be a string or a list of "
                              "{\"type\": \"text\", \"text\": ...} parts (this server serves text only).",
                         f"messages[{i}].content")


#: apply_chat_template's own arguments, which mlx-lm sets (a request's chat_template_kwargs may not)
TEMPLATE_ARGS = ("conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                 "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                 "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")


def _check_template_kwargs(kwargs) -> None:
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise HTTPError(400, "chat_template_kwargs must be an object of template variables, e.g. "
                          "{\"enable_thinking\": false}.", "chat_template_kwargs")
    taken = sorted(set(kwargs) & set(TEMPLATE_ARGS))
    if taken:
        raise HTTPError(400, f"chat_template_kwargs may not set {taken[0]!r} (the server sets it); send template "
                          "variables only.", f"chat_template_kwargs.{taken[0]}")


# ------------------------------------------------------------------------------------------ GET
def get(handler, path: str) -> None:
    app = handler.app
    if path == "/v1/reap/stats":
        return handler.send_json(200, stats(app))
    if path == "/v1/reap/info":
        return handler.send_json(200, app.info())
    if path == "/v1/reap/steer":
        return handler.send_json(200, steer_state(app))
    raise HTTPError(404, f"no route GET {path}; REAP routes: /v1/reap/stats, /v1/reap/info, /v1/reap/steer.")


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
    raise HTTPError(404, f"no route POST {path}; REAP routes: /v1/reap/save, /v1/reap/reset, /v1/reap/steer.")


def delete_steer(handler) -> None:
    app = handler.app
    counter = app.counter_or_503()
    app.generator.post_steering(None)
    applied = counter.sync(app.generation_alive)
    handler.send_json(200, {"active": False, "steering": None, "applied": applied})


def confined(app, value, field: str) -> Path:
    """``value`` as a path inside the data directory (relative paths are relative to it), else 403; a name
    this filesystem cannot hold (a component over its NAME_MAX, the whole over PATH_MAX) is a 400."""
    if not isinstance(value, str) or not value.strip() or "\x00" in value:
        raise HTTPError(400, f"{field} must be a non-empty path string.", field)
    root = app.data_dir
    try:
        p = Path(value).expanduser()
    except RuntimeError:  # ~user of an unknown user
        raise HTTPError(403, f"{field} {value!r} names a home directory; name a path inside the server's data "
                          f"directory {root} (--data-dir).", field) from None
    try:
        resolved = (p if p.is_absolute() else root / p).resolve()
    except (RuntimeError, OSError) as e:  # a symlink loop (3.11 raises RuntimeError for it), an unreadable link
        why = "runs into a symlink loop" if isinstance(e, RuntimeError) or e.errno == errno.ELOOP else e.strerror
        raise HTTPError(400, f"{field} {value!r} {why}; name another path inside the server's data directory "
                          f"{root} (--data-dir).", field) from None
    if not resolved.is_relative_to(root):
        raise HTTPError(403, f"{field} {value!r} resolves outside the server's data directory {root} (--data-dir); "
                          "name a path inside it.", field)
    name_max, path_max = os.pathconf(root, "PC_NAME_MAX"), os.pathconf(root, "PC_PATH_MAX")
    longest = max(len(os.fsencode(part)) for part in resolved.relative_to(root).parts or ("",))
    if longest > name_max or len(os.fsencode(resolved)) >= path_max:
        raise HTTPError(400, f"{field} is too long for this filesystem (names of at most {name_max} bytes, paths of "
                          f"less than {path_max}); choose a shorter name.", field)
    return resolved


#: what a save answers 400 to (the request's path, not the server, is at fault)
PATH_ERRNOS = (errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.EEXIST, errno.EINVAL)


def save(app, body: dict) -> dict:
    from ..core import writer

    unknown = sorted(set(body) - {"path", "force"})
    if unknown:
        raise HTTPError(400, f"unknown field {unknown[0]!r}; save takes {{\"path\": \"<file>.npz\", \"force\": "
                          "false}.", unknown[0])
    if "path" not in body:
        raise HTTPError(400, "path is required: {\"path\": \"<file>.npz\"} (inside --data-dir).", "path")
    force = body.get("force", False)
    if not isinstance(force, bool):
        raise HTTPError(400, "force must be true (replace an existing file) or false.", "force")
    path = confined(app, body["path"], "path")
    if path.suffix != ".npz":
        raise HTTPError(400, f"path {body['path']!r} must end in .npz (the format prune --saliency reads).", "path")
    counter = app.counter_or_503()
    synced = counter.sync(app.generation_alive)
    acc, totals = counter.snapshot()
    try:
        with writer.output(path, kind="file", suffix=".npz", inputs={"--model": app.model_path}, flag="path",
                           force=force, force_flag='"force": true') as res:
            acc.write_npz(res.tmp)
    except UserError as e:
        raise HTTPError(400, str(e), "path") from None
    except OSError as e:
        if e.errno not in PATH_ERRNOS:
            raise
        raise HTTPError(400, f"path {body['path']!r}: {e.strerror}; choose another path.", "path") from None
    return {"path": str(path), "synced": synced, **totals}


def post_steer(app, body: dict) -> dict:
    from ..experts.steering import SteeringError, for_adapter

    counter = app.counter_or_503()
    unknown = sorted(set(body) - set(STEER_KEYS))
    if unknown:
        raise HTTPError(400, f"unknown field {unknown[0]!r}; steering takes {', '.join(STEER_KEYS)}.", unknown[0])
    kw = {k: body[k] for k in ("deactivate", "activate", "mask_value", "boost_value", "scheme", "boost_experts")
          if k in body}
    safety_mode, domain_mode = body.get("safety_mode"), body.get("domain_mode")
    if "mode" in body:
        if ("safety_map" in body) == ("domain_map" in body):
            raise HTTPError(400, "mode goes with exactly one of safety_map / domain_map; with both, use safety_mode "
                              "and domain_mode.", "mode")
        if "safety_map" in body:
            safety_mode = body["mode"]
        else:
            domain_mode = body["mode"]
    names = {"safety_mode": "mode" if "mode" in body and "safety_map" in body else "safety_mode",
             "domain_mode": "mode" if "mode" in body and "domain_map" in body else "domain_mode"}
    paths = {k: confined(app, body[k], k) for k in ("safety_map", "domain_map") if k in body}
    if not paths and not kw.keys() & {"deactivate", "activate"}:
        raise HTTPError(400, "nothing to steer: give safety_map, domain_map, deactivate or activate "
                          "(DELETE /v1/reap/steer removes steering).")
    try:
        steering = for_adapter(counter.adapter, safety_map=paths.get("safety_map"), safety_mode=safety_mode,
                               domain_map=paths.get("domain_map"), domain_mode=domain_mode, field_names=names, **kw)
    except SteeringError as e:
        raise HTTPError(400, str(e), e.field) from None
    except UserError as e:
        raise HTTPError(400, str(e)) from None
    app.generator.post_steering(steering)
    applied = counter.sync(app.generation_alive)
    return {"active": not steering.empty, "steering": steering.to_json(), "applied": applied}
