"""The ``serve`` job: an OpenAI-compatible server (mlx-lm's) that counts expert use and takes steering over REST.

``run(...)`` serves until Ctrl+C / SIGTERM / SIGHUP and returns what it served (and saved, with ``auto_save``);
``start(...)`` takes the same arguments (but ``force`` and ``on_ready``) and returns the running
:class:`mlx_fun.serve.app.Server` (tests, benchmarks, embedding). The machinery lives in :mod:`mlx_fun.serve`;
the option groups in :mod:`mlx_fun.serve.options`::

    from mlx_fun import jobs
    from mlx_fun.serve.options import ServerOptions
    server = jobs.serve.start(model="data/tiny-moe", server=ServerOptions(port=0))
    print(server.url)
    server.stop()
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated

import click

from ..core.options import Opt, check_path
from ..errors import UserError, param
from ..model.genopts import DRAFT_MODEL, GenOptions
from ..model.lora import ADAPTER_PATH
from ..serve.options import API_KEY_ENV, ServerOptions, StartupSteering
from ..settings import RunSettings
from .common import MODEL, Log, check_supported, force, job, quiet

MODES = ("lightweight", "full")


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
    bad = next((c for c in key or "" if not " " <= c <= "~"), None)
    if bad is not None:  # an HTTP header carries printable ASCII only: no client could send this key
        raise UserError(f"{where} holds {bad!r}, which no client can send in an HTTP header; use printable ASCII "
                        "only (letters, digits, punctuation).")
    return key


#: what a --chat-template value that names a file ends with (a Jinja template itself never does)
TEMPLATE_SUFFIXES = (".jinja", ".jinja2", ".j2", ".txt", ".tmpl")


def _chat_template(value: str | None) -> str | None:
    """The template text of ``chat_template``: a file's contents, or the value itself when it is Jinja text. A
    value that looks like a path (a template suffix, or a path separator and no ``{``) must name a file; any other
    value must hold Jinja (a ``{``)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    looks_like_path = value.lower().endswith(TEMPLATE_SUFFIXES) or (
        "{" not in value and (os.sep in value or (os.altsep or os.sep) in value))
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
            raise UserError(f"{param('chat_template')} {value}: cannot read it ({why}).") from None
    if looks_like_path or path.is_dir():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise UserError(f"{param('chat_template')} {value} {what}; give a Jinja template file (or the template "
                        "text itself).")
    if "{" not in value:  # no file, and no Jinja either: a template that could not show a message
        raise UserError(f"{param('chat_template')} {value!r} is neither a file nor a Jinja template (no {{{{ ... }}}} "
                        "or {% ... %}); give a template file or the template text.")
    return value


def _token_limits(config: dict, max_tokens: int | None, max_tokens_limit: int | None) -> tuple[int, int, int]:
    """(max_tokens, max_tokens_limit, context): a request's default, its most, the model's context length."""
    from ..model.io import context_length

    context = context_length(config) or FALLBACK_CONTEXT
    limit = context if max_tokens_limit is None else max_tokens_limit
    default = min(512, limit) if max_tokens is None else max_tokens
    if default > limit:
        raise UserError(f"{param('max_tokens')} {default} is above {param('max_tokens_limit')} {limit}; lower it "
                        f"or raise the limit.")
    return default, limit, context


def _checked(*, model, mode, auto_save, server: ServerOptions, steering: StartupSteering, settings: RunSettings,
             generation: GenOptions, draft_model, adapter_path=None) -> dict:
    """Check what the groups could not check when built (each checked its own fields and rules), before binding
    or loading; returns the normalised values: ``server`` (its ``data_dir`` resolved, ``chat_template`` read from
    its file, ``api_key`` from ``MLX_FUN_API_KEY``, ``max_tokens`` / ``max_tokens_limit`` / ``max_prompt_tokens``
    decided), ``context``, ``auto_save``. The paths are checked here as ``@job`` checks :func:`run`'s, for
    :func:`start` (which is no job)."""
    from .. import mlx_lm_compat
    from ..model import lora

    mlx_lm_compat.require("serve")
    check_path("draft_model", draft_model, DRAFT_MODEL)
    check_path("adapter_path", adapter_path, ADAPTER_PATH)
    if adapter_path is not None:
        lora.check(adapter_path)
    generation.check(draft=draft_model)
    config = check_supported(model)
    if mode not in MODES:
        raise UserError(f"{param('mode')} must be one of {', '.join(MODES)}, got {mode!r}.")
    data = Path(server.data_dir).expanduser()
    if not data.is_dir():
        raise UserError(f"{param('data_dir')} {server.data_dir} is not a directory; create it or pass another one.")
    max_tokens, max_tokens_limit, context = _token_limits(config, server.max_tokens, server.max_tokens_limit)
    steering.check_paths()
    template = _chat_template(server.chat_template)
    _check_settings(settings)
    server = replace(server, data_dir=data.resolve(), chat_template=template, api_key=_api_key(server.api_key),
                     max_tokens=max_tokens, max_tokens_limit=max_tokens_limit,
                     max_prompt_tokens=server.max_prompt_tokens or context)
    return {"server": server, "context": context, "auto_save": None if auto_save is None else Path(auto_save)}


def _check_settings(settings: RunSettings) -> None:
    """``settings`` as serve uses it: its dispatch, table and dequant cache; no ``token_budget`` (mlx-lm's server
    feeds prompts ``prefill_step_size`` tokens per forward)."""
    if settings.token_budget is not None:
        raise UserError(f"{param('token_budget')} does not apply to serve: it prefills prompts "
                        f"{param('prefill_step_size')} tokens per forward; set that (a ServerOptions field) instead.")
    settings.check()


def _never_fails(log: Log) -> Log:
    """``log`` that cannot stop the server: a status line to a closed stderr (``serve ... 2>&1 | head -1``) is
    dropped, so shutdown still stops serving and writes the auto-save file."""

    def safe(line: str) -> None:
        try:
            log(line)
        except OSError:
            pass

    return safe


def _reserve(auto_save, *, force: bool):
    """The auto-save reservation (refused now, before the model loads, if the file exists and not ``force``), or
    a context that yields None."""
    import contextlib

    from ..core import writer

    if auto_save is None:
        return contextlib.nullcontext()
    return writer.output(auto_save, kind="file", suffix=".npz", flag=param("auto_save"), force=force,
                         force_flag=param("force"))


def start(
    *,
    model: str | Path,
    mode: str = "lightweight",
    auto_save: str | Path | None = None,
    server: ServerOptions = ServerOptions(),
    steering: StartupSteering = StartupSteering(),
    settings: RunSettings = RunSettings(),
    generation: GenOptions = GenOptions(),
    draft_model: str | Path | None = None,
    adapter_path: str | Path | None = None,
    log: Log = quiet,
):
    """Start serving ``model`` on ``server.host:server.port`` in the background; returns the running server
    (``.url``, ``.counter``, ``.stop()``). Arguments as :func:`run` (``server.log_level`` is :func:`run`'s)."""
    from ..serve.app import start as start_server

    ok = _checked(model=model, mode=mode, auto_save=auto_save, server=server, steering=steering, settings=settings,
                  generation=generation, draft_model=draft_model, adapter_path=adapter_path)
    server = ok["server"]
    if server.api_key is None and server.host not in ("127.0.0.1", "localhost", "::1"):
        log(f"Warning: serving on {server.host} without an API key: anyone who can reach this address can use the "
            f"model and the REST routes; set {param('api_key')} or {API_KEY_ENV}.")
    return start_server(model=str(model), mode=mode, server=server, context=ok["context"], steering=steering,
                        settings=settings, generation=generation, draft_model=draft_model, adapter_path=adapter_path,
                        auto_save=ok["auto_save"], log=log)


@contextlib.contextmanager
def _signals(stop: threading.Event, again: threading.Event):
    """While the block runs (on the main thread), SIGINT / SIGTERM / SIGHUP set ``stop``, a second one ``again``;
    the previous handlers are put back after it."""
    def on_signal(signum, frame):
        (again if stop.is_set() else stop).set()

    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, on_signal) for s in sigs} if main else {}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _wait(served, stop: threading.Event, log: Log) -> None:
    """Until ``stop`` (a signal) is set or mlx-lm's generation thread ends (which ``log`` is told)."""
    while not stop.wait(0.25) and served.app.generation_alive():
        pass
    if not served.app.generation_alive() and not stop.is_set():
        log("Warning: mlx-lm's generation thread stopped; shutting down.")


@job
def run(
    *,
    model: Annotated[str | Path, MODEL],
    adapter_path: Annotated[str | Path | None, ADAPTER_PATH] = None,
    server: ServerOptions = ServerOptions(),
    mode: Annotated[str, Opt("lightweight: freq + weighted_freq; full: also expert output norms (reap, ean), a "
                             "little slower.", type=click.Choice(MODES))] = "lightweight",
    auto_save: Annotated[str | Path | None, Opt(
        "Write the statistics (.npz) here when the server stops (Ctrl+C, SIGTERM, SIGHUP), atomically. An existing "
        "file is refused at start-up unless --force.", type=click.Path(dir_okay=False))] = None,
    force: Annotated[bool, force("an existing --auto-save file")] = False,
    steering: StartupSteering = StartupSteering(),
    settings: RunSettings = RunSettings(),
    generation: GenOptions = GenOptions(),
    draft_model: Annotated[str | Path | None, DRAFT_MODEL] = None,
    log: Log = quiet,
    on_ready=None,
) -> ServeResult:
    """Serve ``model`` until Ctrl+C, SIGTERM or SIGHUP; with ``auto_save`` the statistics are written there
    atomically on the way out (the output is reserved, checked writable, before the model loads; an existing
    file is refused unless ``force``). ``on_ready(server)`` is called once serving.

    ``mode``: ``lightweight`` counts freq and weighted_freq; ``full`` adds output norms (reap / ean).

    ``server`` (:class:`mlx_fun.serve.options.ServerOptions`): how it listens and serves — host, port, the
    ``data_dir`` that paths a request names must stay in, ``api_key`` (or ``MLX_FUN_API_KEY``: requires a Bearer
    token), CORS origins, the body limit, ``max_connections`` / ``request_timeout`` (connections served at once,
    seconds a request may take to arrive), ``max_prompt_tokens`` (default: the context length), ``max_tokens`` (a
    request's default: 512, or ``max_tokens_limit`` when lower) and ``max_tokens_limit`` (the most a request may
    ask for; default: the model's context length), the chat template, mlx-lm's prompt cache, concurrency and
    ``prefill_step_size``, and ``log_level`` (DEBUG / INFO / WARNING / ERROR: Python logging for the server's and
    mlx-lm's messages, INFO logs every request; None leaves logging as it is).

    ``steering`` (:class:`mlx_fun.serve.options.StartupSteering`): the safety / domain map and mode to steer with
    from the start (REST changes it later).

    ``settings`` (:class:`mlx_fun.settings.RunSettings`): ``dispatch`` / ``dispatch_table`` / ``dequant_cache``,
    installed on the served model once it loads. Its ``token_budget`` is refused (mlx-lm's server prefills a prompt
    ``server.prefill_step_size`` tokens per forward: set that) and its ``progress`` is unused (no progress bar).

    ``generation`` (:class:`mlx_fun.model.genopts.GenOptions`, checked as smoke-test checks them) and ``draft_model``:
    mlx-lm's KV-cache and speculative-decoding options, passed where mlx-lm's server takes them; ``max_kv_size``
    (which it lacks) through the prompt cache. With a draft model, ``kv_bits`` or ``max_kv_size`` requests are
    served one at a time (mlx-lm's non-batched path). The draft model's forwards are never counted. A model given
    as a repo id is served under that id.

    ``adapter_path``: a LoRA adapter fused into the served model as it loads (:mod:`mlx_fun.model.lora`): what is
    served and counted is the fine-tune; /v1/reap/info and the ``auto_save`` file name the adapter.
    """
    import logging

    if server.log_level is not None:
        logging.basicConfig(level=getattr(logging, server.log_level.upper()),
                            format="%(asctime)s %(levelname)s %(message)s")

    log = _never_fails(log)
    _checked(model=model, mode=mode, auto_save=auto_save, server=server, steering=steering, settings=settings,
             generation=generation, draft_model=draft_model, adapter_path=adapter_path)
    stop, again = threading.Event(), threading.Event()
    begin = time.perf_counter()
    with _signals(stop, again):
        with _reserve(auto_save, force=force) as res:
            served = start(model=model, mode=mode, auto_save=auto_save, server=server, steering=steering,
                           settings=settings, generation=generation, draft_model=draft_model,
                           adapter_path=adapter_path, log=log)
            try:
                log(f"Serving {served.app.model_id} ({mode} counting) on {served.url}; Ctrl+C stops"
                    + (f" and saves the statistics to {auto_save}" if auto_save is not None else "") + ".")
                if on_ready is not None:
                    on_ready(served)
                _wait(served, stop, log)
            finally:
                log("Stopping (Ctrl+C again: stop without waiting for the current request) ...")
                served.stop(interrupted=again)
            acc, totals = served.counter.snapshot()
            if res is not None:
                acc.adapter = served.app.adapter
                acc.write_npz(res.tmp)
    return ServeResult(served.url, totals["request_count"], totals["token_count"], time.perf_counter() - begin,
                       None if auto_save is None else Path(auto_save))
