"""The option groups of the ``serve`` job (:mod:`mlx_fun.jobs.serve`): how the server listens and serves
(:class:`ServerOptions`) and the steering it starts with (:class:`StartupSteering`). Their field names are the
``mlx-fun serve`` option names (``cli.common.take`` builds them from the parsed options)::

    from mlx_fun import jobs
    from mlx_fun.serve.options import ServerOptions, StartupSteering
    server = jobs.serve.start(model="data/tiny-moe", server=ServerOptions(port=0, data_dir="reports"),
                              steering=StartupSteering(safety_map="reports/safety_report.json", steering_mode="safe"))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError, param


@dataclass(frozen=True)
class ServerOptions:
    """How the server listens and serves: ``host`` / ``port`` (0: a free one) to bind; ``data_dir``: the only
    directory REST requests may read reports from or save statistics to; ``api_key`` (None: ``MLX_FUN_API_KEY``,
    else none) a Bearer token every route but /health requires; ``allowed_origins``: CORS origins;
    ``max_body_bytes``: the largest request body; ``max_connections``: connections served at once (more wait
    in the listen queue, unread, until one ends); ``request_timeout``: seconds a request's line, headers and body
    may take to arrive (an idle connection is closed after as long); ``max_prompt_tokens``: the longest prompt
    (templated tokens; default: the model's context length); ``max_tokens``: a request's default (512, or
    ``max_tokens_limit`` when lower), ``max_tokens_limit``: the most a request may ask for (default: the model's
    context length); ``chat_template``: a Jinja string or a file holding one; ``prompt_cache_size`` /
    ``prompt_cache_bytes`` / ``decode_concurrency`` / ``prompt_concurrency`` / ``prefill_step_size``: mlx-lm's
    server options of those names (a prompt is prefilled ``prefill_step_size`` tokens per forward);
    ``log_level`` (DEBUG / INFO / WARNING / ERROR; only :func:`mlx_fun.jobs.serve.run` reads it) sets up Python
    logging for the server's and mlx-lm's messages (INFO logs every request); None leaves logging as it is."""

    host: str = "127.0.0.1"
    port: int = 8080
    data_dir: str | Path = "."
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    max_body_bytes: int = 8 << 20
    max_connections: int = 64
    request_timeout: float = 30.0
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    max_tokens_limit: int | None = None
    chat_template: str | None = None
    prompt_cache_size: int = 10
    prompt_cache_bytes: int | None = None
    decode_concurrency: int = 32
    prompt_concurrency: int = 8
    prefill_step_size: int = 2048
    log_level: str | None = None


@dataclass(frozen=True)
class StartupSteering:
    """The steering the server starts with (REST changes it later): ``safety_map`` (a ``safety-scan`` report) with
    ``steering_mode`` (``safe``: boost its HRCG experts; ``unsafe``: mask its safety-critical experts), and/or
    ``domain_map`` (a ``domain-scan`` report) with ``domain_steering_mode`` (``boost`` / ``suppress``);
    ``steering_scheme``: ``additive`` or ``rank`` (see :mod:`mlx_fun.experts.steering`)."""

    safety_map: str | Path | None = None
    steering_mode: str | None = None
    domain_map: str | Path | None = None
    domain_steering_mode: str | None = None
    steering_scheme: str = "additive"

    def check(self) -> "StartupSteering":
        """A one-line ``UserError`` for a map that does not exist or a map without its mode (or the reverse)."""
        from ..errors import require_path

        require_path("safety_map", self.safety_map, "pass a safety_report.json written by `mlx-fun safety-scan`")
        require_path("domain_map", self.domain_map, "pass a domain_report.json written by `mlx-fun domain-scan`")
        for path, mode_value, path_name, mode_name in (
                (self.safety_map, self.steering_mode, "safety_map", "steering_mode"),
                (self.domain_map, self.domain_steering_mode, "domain_map", "domain_steering_mode")):
            if (path is None) != (mode_value is None):
                given, missing = (path_name, mode_name) if path is not None else (mode_name, path_name)
                raise UserError(f"{param(given)} needs {param(missing)} too.")
        return self

    def builder(self):
        """None without a map, else ``build(counter) -> Steering`` for :func:`mlx_fun.serve.app.start` (errors
        name these fields)."""
        if self.safety_map is None and self.domain_map is None:
            return None

        def build(counter):
            from ..experts.steering import for_adapter

            return for_adapter(counter.adapter, safety_map=self.safety_map, safety_mode=self.steering_mode,
                               domain_map=self.domain_map, domain_mode=self.domain_steering_mode,
                               scheme=self.steering_scheme,
                               field_names={"safety_map": param("safety_map"), "safety_mode": param("steering_mode"),
                                            "domain_map": param("domain_map"),
                                            "domain_mode": param("domain_steering_mode"),
                                            "scheme": param("steering_scheme")})

        return build


__all__ = ["ServerOptions", "StartupSteering"]
