"""mlx-lm's model provider and response generator, subclassed to count and steer (nothing of theirs is copied).

- :class:`ServedModelProvider` loads the model exactly as ``mlx_lm.server`` does (on mlx-lm's generation thread),
  then installs mlx-fun's runtime dispatch (as its :class:`mlx_fun.settings.RunSettings` say) and the counting
  hooks (:mod:`mlx_fun.serve.counting`), and maps every name of the served model to one model key, so a request
  never loads anything else.
- :class:`CountingResponseGenerator` runs mlx-lm's generation loop unchanged; between its iterations (the
  ``_next_request`` call, on the generation thread, between forward passes) it flushes the counts, applies a
  steering change atomically (one bias swap for all layers) and empties the prompt cache when the routing
  changed, so no KV state computed under other steering is reused.

A LoRA adapter (``--adapter-path``) is fused into the served model as it loads (:func:`mlx_fun.model.lora.apply`),
and every name of the model maps to it, so a request's ``adapters`` never loads another. mlx-lm's generation options
(:mod:`mlx_fun.model.genopts`, checked by the job before anything binds or loads) go where mlx-lm's server takes
them: ``kv_bits`` / ``kv_group_size`` / ``quantized_kv_start`` / ``num_draft_tokens`` in its
``cli_args``; the draft model is loaded by :func:`mlx_fun.model.genopts.load_draft` (one line for another vocabulary,
where mlx-lm only warns) and never hooked, so its forwards are not counted. ``max_kv_size``, which mlx-lm's server
lacks, is :class:`ServedPromptCache`: a prompt the prompt cache has nothing for starts from the rotating cache
``make_prompt_cache(model, max_kv_size)`` that ``mlx_lm.generate`` makes. A draft model, ``kv_bits`` or
``max_kv_size`` serve one request at a time (mlx-lm's non-batched path).
"""

from __future__ import annotations

import argparse
import contextvars
import logging
import threading
from pathlib import Path

from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from mlx_lm.server import ModelProvider, ResponseGenerator

from ..model import moe_hook
from ..model.genopts import GenOptions, load_draft
from ..settings import RunSettings
from .counting import TrafficCounter, attach
from .errors import HTTPError
from .options import ServerOptions


def server_args(*, model: str, server: ServerOptions, prompt_concurrency: int, options: GenOptions | None = None,
                draft_model: str | None = None, adapter_path: str | None = None) -> argparse.Namespace:
    """The namespace mlx-lm's server classes read (``mlx_lm.server.main``'s options) from ``server`` (as
    :func:`mlx_fun.jobs.serve.start` normalised it), with mlx-lm's generation ``options`` (``max_kv_size`` aside:
    :class:`ServedPromptCache`), ``draft_model`` and ``adapter_path`` (which :class:`ServedModelProvider` loads
    itself, as it does the default chat template)."""
    options = options or GenOptions()
    return argparse.Namespace(
        model=model, adapter_path=adapter_path, draft_model=draft_model, num_draft_tokens=options.num_draft_tokens,
        trust_remote_code=server.trust_remote_code, chat_template=server.chat_template or "",
        use_default_chat_template=False, chat_template_args=dict(server.chat_template_args or {}), temp=server.temp,
        top_p=server.top_p, top_k=server.top_k, min_p=server.min_p, max_tokens=server.max_tokens,
        decode_concurrency=server.decode_concurrency, prompt_concurrency=prompt_concurrency,
        prefill_step_size=server.prefill_step_size, prompt_cache_size=server.prompt_cache_size,
        prompt_cache_bytes=server.prompt_cache_bytes, kv_bits=options.kv_bits, kv_group_size=options.kv_group_size,
        quantized_kv_start=options.quantized_kv_start, pipeline=False, allowed_origins=list(server.allowed_origins),
        log_level="WARNING",
    )


class ServedModelProvider(ModelProvider):
    """mlx-lm's ``ModelProvider`` for one model, which it hooks for counting right after loading it."""

    def __init__(self, cli_args: argparse.Namespace, *, aliases: list[str], norms: bool,
                 settings: RunSettings | None = None, max_kv_size: int | None = None,
                 use_default_chat_template: bool = False):
        super().__init__(cli_args)
        self.max_kv_size = max_kv_size
        self.use_default_chat_template = use_default_chat_template
        for name in aliases:  # every name a client may use → the one served model (no other path is ever loaded)
            self._model_map[name] = cli_args.model
            self._adapter_map[name] = cli_args.adapter_path  # a request's "adapters" never loads another
        self.norms = norms
        self.settings = settings or RunSettings()  # the dispatch installed once the model loads
        self.counter: TrafficCounter | None = None
        self.dispatch_mode = "mlx-lm"
        self.ready = threading.Event()
        self.load_error: BaseException | None = None

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        from ..model import chat, lora

        try:
            super()._load(model_path, None, None)
            if adapter_path is not None:  # fused, so the dispatch and the counting hooks see plain weights
                lora.apply(self.model, adapter_path)
            if self.use_default_chat_template:  # mlx-lm's, which fails where transformers has no default template
                chat.use_default_template(self.tokenizer)
            if draft_model_path is not None:  # as mlx-lm's _load, through mlx-fun's loader and vocabulary check
                self.draft_model = load_draft(draft_model_path, self.tokenizer)
            self.model_key = (model_path, adapter_path, draft_model_path)
            if self.draft_model is not None or self.max_kv_size is not None:
                self.is_batchable = False  # mlx-lm's batched path: no draft model, caches of its own making
            self._hook()
        except Exception as e:  # the main thread stops the server with it as one line (mlx-lm's loop, were it
            self.load_error = e  # raised, would log a traceback as it ended); serving never started, so it is idle
            self.reset()
        except BaseException as e:
            self.load_error = e
            raise
        finally:
            self.ready.set()

    def _hook(self) -> None:
        from ..adapters import get_adapter
        from ..model.io import read_config

        config = read_config(self.cli_args.model)
        adapter = get_adapter(self.model, config)
        self.dispatch_mode = self.settings.apply(self.model).mode
        self.counter = TrafficCounter(adapter, norms=self.norms)
        attach(self.model, self.counter)

    def fresh_cache(self) -> list:
        """A new KV cache for the served model as ``mlx_lm.generate`` makes it (rotating with ``max_kv_size``)."""
        return make_prompt_cache(self.model, self.max_kv_size)


class ServedPromptCache(LRUPromptCache):
    """mlx-lm's prompt cache; a prompt it has nothing for gets ``fresh()`` (where mlx-lm's server would make a
    plain ``make_prompt_cache(model)``), which is how ``--max-kv-size`` reaches mlx-lm's non-batched path."""

    def __init__(self, max_size: int, fresh=None):
        super().__init__(max_size)
        self.fresh = fresh

    def fetch_nearest_cache(self, model, tokens):
        cache, rest = super().fetch_nearest_cache(model, tokens)
        if cache is None and self.fresh is not None:
            cache = self.fresh()
        return cache, rest

    def insert_cache(self, model, tokens, prompt_cache, **kw):
        """Filed under the tokens every cache of ``prompt_cache`` holds (those past it trimmed off). mlx-lm's server
        files a response's caches under all its tokens, but with a draft model the model never fed a last token it
        produced itself (and the draft's cache may lag one more): a later prompt would reuse a cache a token short of
        what it claims (one cached token too many) and generate over shifted positions."""
        held = min((c.offset for c in prompt_cache if isinstance(getattr(c, "offset", None), int)),
                   default=len(tokens))
        if held < len(tokens) and all(c.is_trimmable() for c in prompt_cache):
            if held == 0:
                return
            for c in prompt_cache:
                c.trim(c.offset - held)
            tokens = tokens[:held]
        super().insert_cache(model, tokens, prompt_cache, **kw)


class CountingResponseGenerator(ResponseGenerator):
    """mlx-lm's ``ResponseGenerator``; flushes counts and swaps steering between loop iterations."""

    def __init__(self, model_provider: ServedModelProvider, prompt_cache, *, max_prompt_tokens: int | None = None):
        self.max_prompt_tokens = max_prompt_tokens  # None: any length
        self._context = contextvars.copy_context()  # the job's (how errors name flags) for the generation thread
        self._steering_lock = threading.Lock()
        self._steering_next = None  # (Steering or None, its route steers) posted by an HTTP thread, applied by the loop
        self.steering = None
        super().__init__(model_provider, prompt_cache)

    @property
    def counter(self) -> TrafficCounter | None:
        return self.model_provider.counter

    def post_steering(self, steering) -> None:
        """Queue ``steering`` (None: remove all); the generation loop applies it before its next forward."""
        steers = None if steering is None else steering.route_steers(self.counter.adapter)
        with self._steering_lock:
            self._steering_next = (steering, steers)

    def generate(self, request, generation_args, progress_callback=None):
        """mlx-lm's ``generate`` (called once per completion that passed mlx-lm's checks), counted once the loop
        took the request (a prompt its template or tokenizer refuses raises here, uncounted, as nothing ran)."""
        out = super().generate(request, generation_args, progress_callback)
        if self.counter is not None:
            self.counter.count_request()
        return out

    def _tokenize(self, tokenizer, request, args):
        """mlx-lm's (templated) tokens of a request, refused (400 naming ``prompt`` / ``messages``) when longer than
        ``max_prompt_tokens``: raised here, on the generation thread before any forward, it reaches the request's
        handler as mlx-lm hands it every tokenizer failure (nothing ran, nothing is counted)."""
        out = super()._tokenize(tokenizer, request, args)
        n, limit = len(out[0]), self.max_prompt_tokens
        if limit is not None and n > limit:
            field = "messages" if request.request_type == "chat" else "prompt"
            raise HTTPError(400, f"{field} is {n:,} tokens{' with the chat template' if field == 'messages' else ''}"
                                 f", over this server's limit of {limit:,} (the model's context length, or "
                                 "--max-prompt-tokens); send a shorter one.", field)
        return out

    def _between_passes(self) -> None:
        counter = self.counter
        if counter is None:
            return
        with self._steering_lock:
            change, self._steering_next = self._steering_next, None
        if change is not None:
            steering, steers = change
            moe_hook.set_steer(counter.adapter, steers)
            self.steering = steering if steering is not None and not steering.empty else None
            self.prompt_cache.trim_to(n_sequences=0)  # KV states computed under other routing
            logging.info("steering %s", "removed" if self.steering is None else "applied")
        counter.serve_sync()

    def _next_request(self, timeout=None):
        self._between_passes()
        return super()._next_request(timeout)

    def _run_generate(self):
        self._context.run(self._run_counted)

    def _run_counted(self):
        try:
            super()._run_generate()
        finally:  # the last forwards of a stopping server are still counted (on this thread, as all flushes)
            if self.counter is not None:
                try:
                    self.counter.flush()
                    self.counter.serve_sync()
                except Exception:  # noqa: BLE001 - shutting down: never mask the loop's own outcome
                    logging.exception("could not count the last forwards")


def model_aliases(model: str, name: str | None = None) -> list[str]:
    """Names a request may give the served model: ``default_model``, the path as given, resolved, its name, and
    ``name`` (the repo id it was fetched as)."""
    p = Path(model)
    return sorted({"default_model", model, str(p.resolve()), p.resolve().name} | ({name} if name else set()))
