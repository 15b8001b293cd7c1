"""The ``serve`` job: an OpenAI-compatible server (mlx-lm's) that counts expert use and takes steering over REST.

``run(...)`` serves until Ctrl+C / SIGTERM / SIGHUP and returns what it served (and saved, with ``auto_save``);
``start(...)`` takes the same arguments and returns the running :class:`mlx_fun.serve.app.Server` (tests,
benchmarks, embedding). The machinery lives in :mod:`mlx_fun.serve`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError, param
from .common import Log, check_supported, quiet, require_path

MODES = ("lightweight", "full")
API_KEY_ENV = "MLX_FUN_API_KEY"


@dataclass
class ServeResult:
    url: str
    requests: int
    tokens: int
    seconds: float
    saved: Path | None = None
    warnings: list[str] = field(default_factory=list)


#: the --max-tokens-limit of a model whose config names no context length
FALLBACK_CONTEXT = 32768


def _api_key(api_key: str | None) -> str | None:
    """The key from ``api_key`` or ``MLX_FUN_API_KEY``; an empty or blank one is refused (it would turn
    authentication off, or lock every client out)."""
    key, where = (api_key, param("api_key")) if api_key is not None else (os.environ.get(API_KEY_ENV), API_KEY_ENV)
    if key is not None and (not key.strip() or key != key.strip()):
        raise UserError(f"{where} is {'empty' if not key.strip() else 'padded with spaces'}; give the key itself "
                        f"(clients send 'Authorization: Bearer <key>'), or leave it unset to serve without one.")
    return key


def _token_limits(config: dict, max_tokens: int | None, max_tokens_limit: int | None) -> tuple[int, int, int]:
    """(max_tokens, max_tokens_limit, context): a request's default, its most, the model's context length."""
    from ..io import context_length

    context = context_length(config) or FALLBACK_CONTEXT
    limit = context if max_tokens_limit is None else max_tokens_limit
    default = min(512, limit) if max_tokens is None else max_tokens
    for name, value in (("max_tokens", default), ("max_tokens_limit", limit)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{param(name)} must be a positive integer, got {value!r}.")
    if default > limit:
        raise UserError(f"{param('max_tokens')} {default} is above {param('max_tokens_limit')} {limit}; lower it "
                        f"or raise the limit.")
    return default, limit, context


def _checked(*, model, mode, data_dir, api_key, max_tokens, chat_template, safety_map, steering_mode, domain_map,
             domain_steering_mode, auto_save, max_body_bytes, port, dequant_cache=0, max_tokens_limit=None,
             kv_bits, kv_group_size, quantized_kv_start, max_kv_size, draft_model, num_draft_tokens, **_) -> dict:
    """Check everything that can be checked before binding or loading; returns the normalised values."""
    from .. import mlx_lm_compat
    from ..genopts import GenOptions

    mlx_lm_compat.require("serve")
    options = GenOptions(kv_bits, kv_group_size, quantized_kv_start, max_kv_size, num_draft_tokens).check(
        draft=draft_model)
    config = check_supported(model)
    if mode not in MODES:
        raise UserError(f"{param('mode')} must be one of {', '.join(MODES)}, got {mode!r}.")
    data = Path(data_dir).expanduser()
    if not data.is_dir():
        raise UserError(f"{param('data_dir')} {data_dir} is not a directory; create it or pass another one.")
    max_tokens, max_tokens_limit, context = _token_limits(config, max_tokens, max_tokens_limit)
    if not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise UserError(f"{param('max_body_bytes')} must be a positive integer, got {max_body_bytes!r}.")
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise UserError(f"{param('port')} must be 0..65535 (0 picks a free port), got {port!r}.")
    require_path("safety_map", safety_map, "pass a safety_report.json written by `mlx-fun safety-scan`")
    require_path("domain_map", domain_map, "pass a domain_report.json written by `mlx-fun domain-scan`")
    for path, mode_value, path_name, mode_name in ((safety_map, steering_mode, "safety_map", "steering_mode"),
                                                   (domain_map, domain_steering_mode, "domain_map",
                                                    "domain_steering_mode")):
        if (path is None) != (mode_value is None):
            given, missing = (path_name, mode_name) if path is not None else (mode_name, path_name)
            raise UserError(f"{param(given)} needs {param(missing)} too.")
    template = chat_template
    if chat_template is not None and Path(chat_template).is_file():
        template = Path(chat_template).read_text(encoding="utf-8")
    from ..dispatch import parse_bytes

    try:
        dequant = parse_bytes(dequant_cache)
    except ValueError as e:
        raise UserError(f"{param('dequant_cache')}: {e}") from None
    return {"data_dir": data.resolve(), "chat_template": template, "api_key": _api_key(api_key),
            "dequant_cache": dequant, "auto_save": None if auto_save is None else Path(auto_save),
            "max_tokens": max_tokens, "max_tokens_limit": max_tokens_limit, "context": context, "options": options}


def _never_fails(log: Log) -> Log:
    """``log`` that cannot stop the server: a status line to a closed stderr (``serve ... 2>&1 | head -1``) is
    dropped, so shutdown still stops serving and writes the auto-save file."""

    def safe(line: str) -> None:
        try:
            log(line)
        except OSError:
            pass

    return safe


def _reserve(auto_save, *, model, force: bool):
    """The auto-save reservation (refused now, before the model loads, if the file exists and not ``force``), or
    a context that yields None."""
    import contextlib

    from .. import writer

    if auto_save is None:
        return contextlib.nullcontext()
    return writer.output(auto_save, kind="file", suffix=".npz", inputs={param("model"): model},
                         flag=param("auto_save"), keep=True, force=force, force_flag=param("force"))


def _params(scope: dict) -> dict:
    """The :func:`start` arguments among ``scope`` (a job's ``locals()``)."""
    import inspect

    return {k: scope[k] for k in inspect.signature(start).parameters if k in scope}


def _startup_steering(safety_map, steering_mode, domain_map, domain_steering_mode, steering_scheme):
    if safety_map is None and domain_map is None:
        return None

    def build(counter):
        from ..steering import for_adapter

        return for_adapter(counter.adapter, safety_map=safety_map, safety_mode=steering_mode, domain_map=domain_map,
                           domain_mode=domain_steering_mode, scheme=steering_scheme,
                           field_names={"safety_map": param("safety_map"), "safety_mode": param("steering_mode"),
                                        "domain_map": param("domain_map"),
                                        "domain_mode": param("domain_steering_mode"),
                                        "scheme": param("steering_scheme")})

    return build


def start(
    *,
    model: str | Path,
    host: str = "127.0.0.1",
    port: int = 8080,
    mode: str = "lightweight",
    auto_save: str | Path | None = None,
    max_tokens: int | None = None,
    max_tokens_limit: int | None = None,
    chat_template: str | None = None,
    safety_map: str | Path | None = None,
    steering_mode: str | None = None,
    domain_map: str | Path | None = None,
    domain_steering_mode: str | None = None,
    steering_scheme: str = "additive",
    data_dir: str | Path = ".",
    api_key: str | None = None,
    dispatch: str = "auto",
    dispatch_table: str | Path | None = None,
    dequant_cache: int | str = 0,
    prompt_cache_size: int = 10,
    prompt_cache_bytes: int | None = None,
    decode_concurrency: int = 32,
    prompt_concurrency: int = 8,
    prefill_step_size: int = 2048,
    max_body_bytes: int = 8 << 20,
    allowed_origins: tuple[str, ...] = (),
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 5000,
    max_kv_size: int | None = None,
    draft_model: str | Path | None = None,
    num_draft_tokens: int = 2,
    log: Log = quiet,
):
    """Start serving ``model`` on ``host:port`` in the background; returns the running server (``.url``,
    ``.counter``, ``.stop()``). Arguments as :func:`run`."""
    from ..serve.app import start as start_server

    ok = _checked(**_params(locals()))
    if ok["api_key"] is None and host not in ("127.0.0.1", "localhost", "::1"):
        log(f"Warning: serving on {host} without an API key: anyone who can reach this address can use the "
            f"model and the REST routes; set {param('api_key')} or {API_KEY_ENV}.")
    return start_server(
        model=str(model), host=host, port=port, mode=mode, data_dir=ok["data_dir"], api_key=ok["api_key"],
        max_tokens=ok["max_tokens"], max_tokens_limit=ok["max_tokens_limit"], context=ok["context"],
        chat_template=ok["chat_template"], decode_concurrency=decode_concurrency,
        prompt_concurrency=prompt_concurrency, prefill_step_size=prefill_step_size,
        prompt_cache_size=prompt_cache_size, prompt_cache_bytes=prompt_cache_bytes,
        allowed_origins=list(allowed_origins), max_body_bytes=max_body_bytes, dispatch=dispatch,
        dispatch_table=dispatch_table, dequant_cache=ok["dequant_cache"], auto_save=ok["auto_save"],
        steering=_startup_steering(safety_map, steering_mode, domain_map, domain_steering_mode, steering_scheme),
        options=ok["options"], draft_model=None if draft_model is None else str(draft_model),
        name=_repo_id(model), log=log)


def _repo_id(model) -> str | None:
    """The Hugging Face repo id ``model`` was resolved from by this job (served under it, as mlx_lm.server serves
    an id); None for a local directory."""
    from ..hub import source

    origin = source(model)
    return origin["repo_id"] if origin is not None and "revision" in origin else None


def run(
    *,
    model: str | Path,
    host: str = "127.0.0.1",
    port: int = 8080,
    mode: str = "lightweight",
    auto_save: str | Path | None = None,
    force: bool = False,
    max_tokens: int | None = None,
    max_tokens_limit: int | None = None,
    chat_template: str | None = None,
    safety_map: str | Path | None = None,
    steering_mode: str | None = None,
    domain_map: str | Path | None = None,
    domain_steering_mode: str | None = None,
    steering_scheme: str = "additive",
    data_dir: str | Path = ".",
    api_key: str | None = None,
    dispatch: str = "auto",
    dispatch_table: str | Path | None = None,
    dequant_cache: int | str = 0,
    prompt_cache_size: int = 10,
    prompt_cache_bytes: int | None = None,
    decode_concurrency: int = 32,
    prompt_concurrency: int = 8,
    prefill_step_size: int = 2048,
    max_body_bytes: int = 8 << 20,
    allowed_origins: tuple[str, ...] = (),
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 5000,
    max_kv_size: int | None = None,
    draft_model: str | Path | None = None,
    num_draft_tokens: int = 2,
    log: Log = quiet,
    log_level: str | None = None,
    on_ready=None,
) -> ServeResult:
    """Serve ``model`` until Ctrl+C, SIGTERM or SIGHUP; with ``auto_save`` the statistics are written there
    atomically on the way out (the output is reserved, checked writable, before the model loads; an existing
    file is refused unless ``force``).

    ``max_tokens`` is a request's default (512, or ``max_tokens_limit`` when lower), ``max_tokens_limit`` the
    most a request may ask for (default: the model's context length).

    ``mode``: ``lightweight`` counts freq and weighted_freq; ``full`` adds output norms (reap / ean). Paths a
    request names stay inside ``data_dir``; ``api_key`` (or ``MLX_FUN_API_KEY``) requires a Bearer token.
    ``log_level`` (DEBUG / INFO / WARNING / ERROR) sets up Python logging for the server's and mlx-lm's messages
    (INFO logs every request); None leaves logging as it is. ``on_ready(server)`` is called once serving.

    ``kv_bits`` … ``num_draft_tokens``: mlx-lm's KV-cache and speculative-decoding options (:mod:`mlx_fun.genopts`,
    checked as smoke-test checks them), passed where mlx-lm's server takes them; ``max_kv_size`` (which it lacks)
    through the prompt cache. With a draft model, ``kv_bits`` or ``max_kv_size`` requests are served one at a time
    (mlx-lm's non-batched path). The draft model's forwards are never counted. A model given as a repo id is served
    under that id.
    """
    import logging

    if log_level is not None:
        logging.basicConfig(level=getattr(logging, log_level.upper()), format="%(asctime)s %(levelname)s %(message)s")

    log = _never_fails(log)
    kw = _params(locals())
    _checked(**kw)
    stop = threading.Event()
    again = threading.Event()

    def on_signal(signum, frame):
        (again if stop.is_set() else stop).set()

    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, on_signal) for s in sigs} if threading.current_thread() is \
        threading.main_thread() else {}
    begin = time.perf_counter()
    try:
        with _reserve(auto_save, model=model, force=force) as res:
            server = start(**kw)
            try:
                log(f"Serving {server.app.model_id} ({mode} counting) on {server.url}; Ctrl+C stops"
                    + (f" and saves the statistics to {auto_save}" if auto_save is not None else "") + ".")
                if on_ready is not None:
                    on_ready(server)
                while not stop.wait(0.25) and server.app.generation_alive():
                    pass
                if not server.app.generation_alive() and not stop.is_set():
                    log("Warning: mlx-lm's generation thread stopped; shutting down.")
            finally:
                log("Stopping (Ctrl+C again: stop without waiting for the current request) ...")
                server.stop(interrupted=again)
            acc, totals = server.counter.snapshot()
            if res is not None:
                acc.write_npz(res.tmp)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return ServeResult(server.url, totals["request_count"], totals["token_count"], time.perf_counter() - begin,
                       None if auto_save is None else Path(auto_save))
