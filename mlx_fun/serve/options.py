"""The option groups of the ``serve`` job (:mod:`mlx_fun.jobs.serve`): how the server listens and serves
(:class:`ServerOptions`) and the steering it starts with (:class:`StartupSteering`). Their field names are the
``mlx-fun serve`` option names, each declared once with its range (:func:`mlx_fun.core.options.option`; the command
line is generated from them and every group checks its fields when built)::

    from mlx_fun import jobs
    from mlx_fun.serve.options import ServerOptions, StartupSteering
    server = jobs.serve.start(model="data/tiny-moe", server=ServerOptions(port=0, data_dir="reports"),
                              steering=StartupSteering(safety_map="reports/safety_report.json", steering_mode="safe"))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click

from ..core.options import Group, option
from ..core.ranges import MIN_P, TEMPERATURE, TOP_K, TOP_P, FiniteFloat, JsonObject
from ..errors import UserError, param
from ..experts.steer_options import BOOST_EXPERTS, BOOST_EXPERTS_DEFAULT, SAFETY_MODE, SCHEME, SCHEME_DEFAULT
from ..model.chat import USE_DEFAULT_CHAT_TEMPLATE
from ..model.genopts import TRUST_REMOTE_CODE

#: the environment variable :func:`mlx_fun.jobs.serve.run` (and ``mlx-fun ui``) read the API key from
API_KEY_ENV = "MLX_FUN_API_KEY"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class ByteSize(click.ParamType):
    """A byte size above 0: a whole number of bytes, or text such as ``8MiB`` (K/M/G are powers of 1024)."""

    name = "size"

    def convert(self, value, param, ctx):
        from ..core.sizes import parse_bytes

        if isinstance(value, bool) or not isinstance(value, (int, str)):
            self.fail(f"{value!r} is not a byte size (e.g. 8388608, 8MiB).", param, ctx)
        try:
            n = parse_bytes(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        if n <= 0:
            self.fail("must be more than 0 bytes", param, ctx)
        return n


class CommaList(click.ParamType):
    """Comma-separated names (``a,b``; blanks dropped) as a tuple; a list or tuple of them as it is."""

    name = "list"

    def convert(self, value, param, ctx):
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
            self.fail(f"{value!r} is not a comma-separated list.", param, ctx)
        return tuple(v.strip() for v in items if v.strip())


@dataclass(frozen=True)
class ServerOptions(Group):
    """How the server listens and serves: ``host`` / ``port`` (0: a free one) to bind; ``data_dir``: the only
    directory REST requests may read reports from or save statistics to; ``api_key`` (None: ``MLX_FUN_API_KEY``,
    else none) a Bearer token every route but /health requires; ``allowed_origins``: CORS origins;
    ``max_body_bytes``: the largest request body; ``max_connections``: connections served at once (more wait
    in the listen queue, unread, until one ends); ``request_timeout``: seconds a request's line, headers and body
    may take to arrive (an idle connection is closed after as long); ``max_prompt_tokens``: the longest prompt
    (templated tokens; default: the model's context length); ``max_tokens``: a request's default (512, or
    ``max_tokens_limit`` when lower), ``max_tokens_limit``: the most a request may ask for (default: the model's
    context length); ``temp`` / ``top_p`` / ``top_k`` / ``min_p``: the sampling of a request that gives none of
    its own (mlx_lm.server's defaults: greedy); ``chat_template``: a Jinja string or a file holding one;
    ``chat_template_args``: keyword arguments of every request's chat template (a request's
    ``chat_template_kwargs`` add to them); ``use_default_chat_template``, ``trust_remote_code``: mlx-lm's;
    ``prompt_cache_size`` /
    ``prompt_cache_bytes`` / ``decode_concurrency`` / ``prompt_concurrency`` / ``prefill_step_size``: mlx-lm's
    server options of those names (a prompt is prefilled ``prefill_step_size`` tokens per forward);
    ``log_level`` (DEBUG / INFO / WARNING / ERROR / CRITICAL; only :func:`mlx_fun.jobs.serve.run` reads it) sets up
    Python logging for the server's and mlx-lm's messages (INFO logs every request); None leaves logging as it is
    (the command line's default is WARNING). Sizes given as text (``"8MiB"``) are held in bytes, origins given as
    ``"a,b"`` as a tuple."""

    host: str = option("127.0.0.1", "Address to bind. Anything but loopback exposes the model: use --api-key then.")
    port: int = option(8080, "Port (0: a free one).", type=click.IntRange(0, 65535))
    max_tokens: int | None = option(
        None, "Default max tokens per completion (a request's max_tokens wins)  [default: 512, or --max-tokens-limit "
        "when lower]", type=click.IntRange(min=1))
    max_tokens_limit: int | None = option(
        None, "Most tokens a request may ask for (larger: 400)  [default: the model's context length "
        "(max_position_embeddings)]", type=click.IntRange(min=1))
    temp: float = option(0.0, "Sampling temperature of a request that gives none (0: greedy).", type=TEMPERATURE)
    top_p: float = option(1.0, "Nucleus top-p of a request that gives none (1 disables).", type=TOP_P)
    top_k: int = option(0, "Top-k of a request that gives none (0 disables).", type=TOP_K)
    min_p: float = option(0.0, "Min-p of a request that gives none (0 disables).", type=MIN_P)
    chat_template: str | None = option(None, "Chat template override: a Jinja string or a file holding one.")
    chat_template_args: dict | None = option(
        None, "Keyword arguments for the chat template of every request, as a JSON object (e.g. "
        "'{\"enable_thinking\": false}'); a request's chat_template_kwargs add to them.", type=JsonObject(),
        metavar="JSON", default_text="{}")
    use_default_chat_template: bool = option(False, USE_DEFAULT_CHAT_TEMPLATE.help)
    trust_remote_code: bool = option(False, TRUST_REMOTE_CODE.help)
    data_dir: str | Path = option(".", "The only directory REST requests may read reports from or save statistics to.",
                                  type=click.Path(file_okay=False))
    # the job reads MLX_FUN_API_KEY when none is given (its messages name the variable then)
    api_key: str | None = option(None, "Require 'Authorization: Bearer <key>' on every route but /health.  "
                                       f"[env var: {API_KEY_ENV}]")
    prompt_cache_size: int = option(10, "mlx-lm prompt cache: distinct KV caches kept (their tokens are not "
                                        "recounted).", type=click.IntRange(min=0))
    prompt_cache_bytes: int | None = option(None, "mlx-lm prompt cache: most bytes kept (e.g. 4GiB).", type=ByteSize(),
                                            metavar="SIZE")
    decode_concurrency: int = option(32, "Requests decoded together in one batch.", type=click.IntRange(min=1))
    prompt_concurrency: int = option(8, "Prompts prefilled together in one batch.", type=click.IntRange(min=1))
    prefill_step_size: int = option(2048, "Prompt tokens per prefill forward.", type=click.IntRange(min=1))
    max_body_bytes: int = option(8 << 20, "Largest request body accepted (larger: 413).", type=ByteSize(),
                                 metavar="SIZE", default_text="8MiB")
    max_prompt_tokens: int | None = option(
        None, "Longest prompt accepted, in tokens after the chat template (longer: 400 naming prompt / messages, "
        "before any prefill)  [default: the model's context length (max_position_embeddings)]",
        type=click.IntRange(min=1))
    max_connections: int = option(
        64, "Connections served at once; at the bound the one waiting longest on its client (idle, half sent) is "
        "closed to make room, else more wait, unread, in the listen queue until one ends.", type=click.IntRange(min=1))
    request_timeout: float = option(
        30.0, "Time a request's line, headers and body may take to arrive (late: closed, 408 for a late body); an "
        "idle connection is closed after as long.", type=FiniteFloat(min=0.0, min_open=True, max=86400.0,
                                                                     max_open=True), metavar="SECONDS")
    allowed_origins: tuple[str, ...] = option((), "Comma-separated origins browsers may call from (CORS); none by "
                                                  "default.", type=CommaList(), metavar="LIST")
    log_level: str | None = option(None, "INFO logs every request.", type=click.Choice(LOG_LEVELS),
                                   default_text="WARNING")

    def validate(self) -> None:
        for name, kind in (("max_body_bytes", ByteSize()), ("prompt_cache_bytes", ByteSize()),
                           ("allowed_origins", CommaList())):  # held as bytes, as a tuple (checked already)
            if (value := getattr(self, name)) is not None:
                object.__setattr__(self, name, kind.convert(value, None, None))


@dataclass(frozen=True)
class StartupSteering(Group):
    """The steering the server starts with (REST changes it later): ``safety_map`` (a ``safety-scan`` report) with
    ``steering_mode`` (``safe``: activate ``steering_boost_experts`` of its HCDG experts; ``unsafe``: deactivate
    them), and/or ``domain_map`` (a ``domain-scan`` report) with ``domain_steering_mode`` (``boost`` /
    ``suppress``); ``steering_scheme``: ``additive`` or ``rank`` (see :mod:`mlx_fun.experts.steering`)."""

    safety_map: str | Path | None = option(
        None, "safety_report.json to steer with from the start (with --steering-mode).",
        type=click.Path(dir_okay=False), missing="pass a safety_report.json written by `mlx-fun safety-scan`")
    steering_mode: str | None = option(None, SAFETY_MODE.help, type=SAFETY_MODE.type)
    domain_map: str | Path | None = option(
        None, "domain_report.json to steer with from the start (with --domain-steering-mode).",
        type=click.Path(dir_okay=False), missing="pass a domain_report.json written by `mlx-fun domain-scan`")
    domain_steering_mode: str | None = option(
        None, "boost: activate --steering-boost-experts of the domain experts; suppress: deactivate the general "
        "experts.",
        type=click.Choice(["boost", "suppress"]))
    steering_scheme: str = option(
        SCHEME_DEFAULT, "How the startup steering acts (see `mlx-fun steer --help`); REST bodies say their own "
        "\"scheme\" (default rank).", type=SCHEME.type)
    steering_boost_experts: int = option(BOOST_EXPERTS_DEFAULT, BOOST_EXPERTS.help + " REST bodies say their own "
                                         "\"boost_experts\".", type=BOOST_EXPERTS.type)

    def validate(self) -> None:
        """A map without its mode (or the reverse) is one line."""
        for path, mode_value, path_name, mode_name in (
                (self.safety_map, self.steering_mode, "safety_map", "steering_mode"),
                (self.domain_map, self.domain_steering_mode, "domain_map", "domain_steering_mode")):
            if (path is None) != (mode_value is None):
                given, missing = (path_name, mode_name) if path is not None else (mode_name, path_name)
                raise UserError(f"{param(given)} needs {param(missing)} too.")

    def builder(self):
        """None without a map, else ``build(counter) -> Steering`` (what :func:`mlx_fun.serve.app.start` applies;
        errors name these fields)."""
        if self.safety_map is None and self.domain_map is None:
            return None

        def build(counter):
            from ..experts.steering import for_adapter

            return for_adapter(counter.adapter, safety_map=self.safety_map, safety_mode=self.steering_mode,
                               domain_map=self.domain_map, domain_mode=self.domain_steering_mode,
                               scheme=self.steering_scheme, boost_experts=self.steering_boost_experts,
                               field_names={"safety_map": param("safety_map"), "safety_mode": param("steering_mode"),
                                            "domain_map": param("domain_map"),
                                            "domain_mode": param("domain_steering_mode"),
                                            "scheme": param("steering_scheme"),
                                            "boost_experts": param("steering_boost_experts")})

        return build


__all__ = ["API_KEY_ENV", "ByteSize", "CommaList", "ServerOptions", "StartupSteering"]
