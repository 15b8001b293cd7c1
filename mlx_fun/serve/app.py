"""A running ``mlx-fun serve``: mlx-lm's server classes, our handler, one threading HTTP server, a clean stop.

:func:`start` binds the port first (a port in use fails in a second), starts mlx-lm's generation thread (which
loads and hooks the model), waits until the model is ready, applies the startup steering and then serves on a
background thread; :class:`Server` is the handle (``url``, ``counter``, ``stop()``). ``mlx_lm.server.run`` is not
used: in mlx-lm 0.32.2 it ignores its ``handler_class``.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path

from mlx_lm.server import get_system_fingerprint

from ..errors import UserError, param
from ..model import lora
from ..model.genopts import GenOptions
from .counting import DRAFT_PROBE, PADDING_PROBE, padding_probe_supported
from .generator import CountingResponseGenerator, ServedModelProvider, ServedPromptCache, model_aliases, server_args
from .handler import HTTPError, ReapHandler
from .options import ServerOptions, StartupSteering

MAX_BODY_BYTES = 8 << 20
ROUTES = [("GET", "/v1/reap/stats"), ("GET", "/v1/reap/info"), ("POST", "/v1/reap/save"),
          ("POST", "/v1/reap/reset"), ("GET", "/v1/reap/steer"), ("POST", "/v1/reap/steer"),
          ("DELETE", "/v1/reap/steer"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
          ("GET", "/v1/models"), ("GET", "/health")]
COUNTING = ("token_count = tokens the model processed through its MoE layers: prompt tokens not served from the "
            "prompt cache plus every generated token fed back (padding of batched prompts excluded); each adds "
            "top_k to every MoE layer's freq row. With a draft model: the served model's forwards only (the draft "
            "model's are not counted), the drafted tokens it rejects excluded.")


@dataclass
class ServeApp:
    """What the handler threads read: settings and the generator (shared, read-only after start)."""

    model_path: Path
    mode: str
    data_dir: Path
    api_key: str | None
    max_body_bytes: int
    allowed_hosts: set[str] | None
    provider: ServedModelProvider
    generator: CountingResponseGenerator
    max_tokens_limit: int
    context: int  # the model's context length (what a *_context_size may name at most)
    max_prompt_tokens: int = 0  # the longest prompt taken, in (templated) tokens; 0: the context length
    request_timeout: float = 30.0  # seconds a request's line, headers and body may take to arrive
    max_connections: int = 64  # connections served at once
    auto_save: Path | None = None
    aliases: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    name: str | None = None  # the Hugging Face repo id the model was fetched as (None: a local directory)
    generation: dict = field(default_factory=dict)  # mlx-lm's generation options, as /v1/reap/info shows them
    adapter: dict | None = None  # the LoRA adapter fused into the model (mlx_fun.model.lora.describe)

    @property
    def model_id(self) -> str:
        """The name the model is served under: its repo id (as mlx_lm.server), else its directory's name."""
        return self.name or self.model_path.resolve().name

    @property
    def counter(self):
        return self.provider.counter

    @functools.cached_property
    def vocab_size(self) -> int:
        """The model's output size (what a logit_bias key must be below), read once."""
        from ..model.io import read_config

        config = read_config(self.model_path)
        size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
        return int(size or self.provider.tokenizer.vocab_size)

    def counter_or_503(self):
        if self.counter is None:
            raise HTTPError(503, "the model is still loading; retry in a moment.")
        return self.counter

    def generation_alive(self) -> bool:
        return self.generator.generation_available()

    def model_card(self, created: int) -> dict:
        return {"id": self.model_id, "object": "model", "created": created, "owned_by": "mlx-fun"}

    def info(self) -> dict:
        counter = self.counter_or_503()
        adapter = counter.adapter
        synced = counter.sync(self.generation_alive)  # every completed response's forwards, as /stats
        _, totals = counter.snapshot()
        steering = self.generator.steering
        return {
            "model": str(self.model_path), "model_id": self.model_id, "model_type": adapter.model_type,
            "num_layers": len(adapter.moe_layers()), "moe_layer_indices": adapter.moe_layers(),
            "num_experts": adapter.num_experts, "top_k": adapter.top_k, "mode": self.mode,
            "dispatch": self.provider.dispatch_mode, **totals, "synced": synced, "counting": COUNTING,
            "max_tokens_limit": self.max_tokens_limit, "max_prompt_tokens": self.max_prompt_tokens,
            "max_connections": self.max_connections, "request_timeout": self.request_timeout,
            "generation": self.generation, "adapter": self.adapter,
            "steering": None if steering is None else steering.to_json(),
            "data_dir": str(self.data_dir), "auto_save": None if self.auto_save is None else str(self.auto_save),
            "api_key_required": bool(self.api_key), "uptime_s": round(time.time() - self.started, 1),
            "routes": [f"{m} {p}" for m, p in ROUTES],
        }


#: the listen backlog: connections the kernel holds until they are accepted (socketserver's default, 5, reset
#: connections of a burst of two dozen clients); the kernel caps it at net.core.somaxconn
LISTEN_BACKLOG = 1024


#: how long a connection must have waited on its client before a server at its bound closes it for a new one
#: (clients between their requests of a burst send the next at once; hostile ones wait far longer)
EVICT_AFTER = 0.25


class _HTTPServer(ThreadingHTTPServer):
    """One thread per connection, at most ``max_connections`` at once. At the bound, the connection that has waited
    longest (at least :data:`EVICT_AFTER`) for its client to send a request is closed to make room
    (:meth:`~mlx_fun.serve.handler.TimedReads.evict`: an idle or half-sent request, never one being answered), so
    clients that send nothing cannot keep the others out; when every connection is being answered, new ones wait,
    unread and without a thread, in the kernel's listen queue until one ends, so a burst queues instead of being
    reset. Each connection then has ``app.request_timeout`` seconds to send each request
    (:class:`~mlx_fun.serve.handler.ReapHandler`); nothing is counted for a request that did not arrive whole."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG
    app: ServeApp
    slots: threading.BoundedSemaphore
    waiting_on: dict  # a served connection's socket -> its TimedReads (the handler registers it)

    def get_request(self):
        if not self.slots.acquire(blocking=False):
            room = self._evict_one() and self.slots.acquire(timeout=1.0)  # the evicted thread ends in a moment
            if not room and not self.slots.acquire(timeout=0.05):  # serve_forever polls again (sees a shutdown)
                raise OSError("at --max-connections")  # _handle_request_noblock returns on OSError, accepting nothing
        try:
            return super().get_request()
        except BaseException:
            self.slots.release()
            raise

    def _evict_one(self) -> bool:
        """Evict the connection waiting longest on its client (True), unless one evicted is still ending (True) or
        none has waited :data:`EVICT_AFTER` (False: every connection is being answered)."""
        now, oldest = time.monotonic(), None
        for reads in list(self.waiting_on.values()):
            if reads.evicted:
                return True
            since = reads.waiting_since
            if since is not None and now - since >= EVICT_AFTER and (oldest is None or since < oldest[0]):
                oldest = (since, reads)
        if oldest is None:
            return False
        oldest[1].evict()
        return True

    def shutdown_request(self, request):
        """Called once for every accepted connection (served, refused or failed): its slot is free again."""
        try:
            self.waiting_on.pop(request, None)
            super().shutdown_request(request)
        finally:
            self.slots.release()


class Server:
    """A started server: ``url``, ``app``, ``counter``; ``stop()`` ends it (idempotent)."""

    def __init__(self, httpd: _HTTPServer, app: ServeApp, probes: list):
        self.httpd, self.app, self._probes = httpd, app, probes
        self.host, self.port = httpd.server_address[:2]
        self._thread = threading.Thread(target=httpd.serve_forever, name="mlx-fun-http", daemon=True)
        self._stopped = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in str(self.host) else self.host
        return f"http://{host}:{self.port}"

    @property
    def counter(self):
        return self.app.counter

    def _serve(self) -> None:
        self._thread.start()

    def stop(self, interrupted: threading.Event | None = None) -> None:
        """Stop serving, let the generation loop finish its step (its last forwards are counted), release."""
        if self._stopped:
            return
        self._stopped = True
        if self._thread.is_alive():
            self.httpd.shutdown()
        self.httpd.server_close()
        gen = self.app.generator
        gen._stop = True  # mlx-lm's own stop flag (what stop_and_join sets)
        while gen._generation_thread.is_alive():
            gen._generation_thread.join(0.2)
            if interrupted is not None and interrupted.is_set():
                break  # a second Ctrl+C: stop waiting for the current request
        else:
            _wait_gone(gen._generation_thread)
        for probe in self._probes:
            probe.remove()
        import mlx.core as mx

        # Without this, a process that ran mlx-lm's generation thread aborts at exit ("terminate called without an
        # active exception"; plain mlx_lm.server used as a library does the same).
        mx.synchronize()


def _wait_gone(thread: threading.Thread, timeout: float = 5.0) -> None:
    """Wait until a joined thread's OS thread has exited (Linux: its ``/proc/self/task`` entry is gone). ``join``
    returns when the Python side is done, before the thread's C++ thread-local destructors run; MLX's take the GIL,
    and one still running when the interpreter finalizes aborts the process ("terminate called without an active
    exception", seen in 1 of 6 Ctrl+C stops of a server under polling)."""
    task = f"/proc/self/task/{thread.native_id}"
    deadline = time.monotonic() + timeout
    while thread.native_id is not None and os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.005)


def _allowed_hosts(host: str, port: int) -> set[str] | None:
    """Host headers accepted when bound to loopback (DNS-rebinding protection); None: bound elsewhere."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        return None
    names = {"127.0.0.1", "localhost", "[::1]", host if ":" not in host else f"[{host}]"}
    return names | {f"{n}:{port}" for n in names}


def _bind(host: str, port: int, max_connections: int) -> _HTTPServer:
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"{param('host')} {host!r} is not an address this machine can bind ({e.strerror}).") from None
    family, _, _, _, address = infos[0]

    class Bound(_HTTPServer):
        address_family = family
        slots = threading.BoundedSemaphore(max_connections)
        waiting_on: dict = {}

    try:
        return Bound(address, lambda *a, **k: ReapHandler(_app_generator(a), *a, **k,
                                                          system_fingerprint=get_system_fingerprint()))
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror}); choose another {param('port')} (0 picks a "
                        "free one) or stop what is using it.") from None


def _repo_id(model) -> str | None:
    """The Hugging Face repo id ``model`` was resolved from by the running job (served under it, as mlx_lm.server
    serves an id); None for a local directory."""
    from ..model.hub import source

    origin = source(model)
    return origin["repo_id"] if origin is not None and "revision" in origin else None


def _app_generator(args) -> CountingResponseGenerator:
    return args[2].app.generator  # (request, client_address, server): the server knows its app


def start(*, model: str, mode: str, server: ServerOptions, context: int, steering: StartupSteering | None = None,
          settings=None, generation: GenOptions | None = None, draft_model: str | Path | None = None,
          adapter_path: str | Path | None = None, auto_save: Path | None = None, log=lambda line: None) -> Server:
    """Bind, load (on mlx-lm's generation thread), hook, steer, serve. ``server``: how it listens and serves, as
    :func:`mlx_fun.jobs.serve.start` normalised it (``data_dir`` resolved, ``api_key`` / ``chat_template`` /
    ``max_tokens`` / ``max_tokens_limit`` / ``max_prompt_tokens`` decided); ``context``: the model's context length;
    ``steering``: the startup steering (None: none); ``settings``: the dispatch to install
    (:class:`mlx_fun.settings.RunSettings`, checked; None: its defaults); ``generation``: mlx-lm's generation options
    (:class:`mlx_fun.model.genopts.GenOptions`, checked), ``draft_model`` its speculative decoding;
    ``adapter_path``: a LoRA adapter fused into the model (checked). A model the job resolved from a repo id is
    served under that id (else under its directory's name)."""
    options = generation or GenOptions()
    draft_model = None if draft_model is None else str(draft_model)
    name = _repo_id(model)
    host, prompt_concurrency = server.host, server.prompt_concurrency
    httpd = _bind(host, server.port, server.max_connections)
    probes = [PADDING_PROBE] if padding_probe_supported() else []
    if not probes and prompt_concurrency > 1:
        log("Warning: this mlx-lm pads batched prompts in a way mlx-fun cannot see; prompts are processed one at "
            "a time (--prompt-concurrency 1) so the counts stay exact.")
        prompt_concurrency = 1
    if draft_model is not None:
        probes.append(DRAFT_PROBE)
    for probe in probes:
        probe.install()
    args = server_args(model=model, server=server, prompt_concurrency=prompt_concurrency, options=options,
                       draft_model=draft_model, adapter_path=None if adapter_path is None else str(adapter_path))
    aliases = model_aliases(model, name)
    provider = ServedModelProvider(args, aliases=aliases, norms=mode == "full", settings=settings,
                                   max_kv_size=options.max_kv_size,
                                   use_default_chat_template=server.use_default_chat_template)
    fresh = provider.fresh_cache if options.max_kv_size is not None else None
    max_prompt_tokens = server.max_prompt_tokens or context
    generator = CountingResponseGenerator(provider, ServedPromptCache(server.prompt_cache_size, fresh),
                                          max_prompt_tokens=max_prompt_tokens)
    port = httpd.server_address[1]
    generation = {**dataclasses.asdict(options), "draft_model": draft_model, "temp": server.temp,
                  "top_p": server.top_p, "top_k": server.top_k, "min_p": server.min_p}
    app = ServeApp(Path(model), mode, Path(server.data_dir), server.api_key, server.max_body_bytes,
                   _allowed_hosts(host, port), provider, generator, server.max_tokens_limit, context, max_prompt_tokens,
                   float(server.request_timeout), server.max_connections, auto_save, aliases, name=name,
                   generation=generation, adapter=lora.describe(adapter_path))
    httpd.app = app
    server = Server(httpd, app, probes)
    try:
        while not provider.ready.wait(0.2):
            if not generator.generation_available():
                break
        if isinstance(provider.load_error, UserError):  # one line of mlx-fun's loader (the draft model's, say)
            raise provider.load_error
        if provider.load_error is not None or provider.counter is None:
            err = provider.load_error
            raise UserError(f"could not load {param('model')} {model}: "
                            f"{err if err is not None else 'generation thread died'}")
        if (line := lora.note(provider.model)) is not None:
            log(f"Note: {line}")
        build = None if steering is None else steering.builder()
        if build is not None:
            s = build(provider.counter)
            if s is not None:
                generator.post_steering(s)
                provider.counter.sync(generator.generation_available)
        server._serve()
    except BaseException:
        server.stop()
        raise
    logging.info("serving %s on %s", app.model_id, server.url)
    return server
