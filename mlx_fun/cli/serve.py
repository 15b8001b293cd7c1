"""``mlx-fun serve``: parses, calls :func:`mlx_fun.jobs.serve.run`, prints."""

from __future__ import annotations

import os
import sys

import click

from .common import (
    FiniteFloat,
    dispatch_option,
    echo_err,
    force_option,
    friendly_errors,
    generation_options,
    model_option,
    run_settings,
    take,
)


def _size(text: str) -> int:
    from ..dispatch.experts import parse_bytes

    try:
        n = parse_bytes(text)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if n <= 0:
        raise click.BadParameter("must be more than 0 bytes")
    return n


@click.command("serve", short_help="OpenAI-compatible server that counts expert use and takes steering over REST.")
@model_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. Anything but loopback exposes the model: use --api-key then.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="Port (0: a free one).")
@click.option("--mode", type=click.Choice(["lightweight", "full"]), default="lightweight", show_default=True,
              help="lightweight: freq + weighted_freq; full: also expert output norms (reap, ean), a little slower.")
@click.option("--auto-save", type=click.Path(dir_okay=False), default=None,
              help="Write the statistics (.npz) here when the server stops (Ctrl+C, SIGTERM, SIGHUP), atomically. "
                   "An existing file is refused at start-up unless --force.")
@force_option("an existing --auto-save file")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="Default max tokens per completion (a request's max_tokens wins)  [default: 512, or "
                   "--max-tokens-limit when lower]")
@click.option("--max-tokens-limit", type=click.IntRange(min=1), default=None,
              help="Most tokens a request may ask for (larger: 400)  [default: the model's context length "
                   "(max_position_embeddings)]")
@click.option("--chat-template", default=None, help="Chat template override: a Jinja string or a file holding one.")
@click.option("--safety-map", type=click.Path(dir_okay=False), default=None,
              help="safety_report.json to steer with from the start (with --steering-mode).")
@click.option("--steering-mode", type=click.Choice(["safe", "unsafe"]), default=None,
              help="safe: boost the report's HRCG experts (at most top_k per layer); unsafe: mask its safety-critical "
                   "experts.")
@click.option("--domain-map", type=click.Path(dir_okay=False), default=None,
              help="domain_report.json to steer with from the start (with --domain-steering-mode).")
@click.option("--domain-steering-mode", type=click.Choice(["boost", "suppress"]), default=None,
              help="boost: activate the domain experts; suppress: deactivate the general experts.")
@click.option("--steering-scheme", type=click.Choice(["additive", "rank"]), default="additive", show_default=True,
              help="How the startup steering acts (see `mlx-fun steer --help`); REST bodies say their own \"scheme\".")
@click.option("--data-dir", type=click.Path(file_okay=False), default=".", show_default=True,
              help="The only directory REST requests may read reports from or save statistics to.")
@click.option("--api-key", default=None, envvar="MLX_FUN_API_KEY", show_envvar=True,
              help="Require 'Authorization: Bearer <key>' on every route but /health.")
@click.option("--prompt-cache-size", type=click.IntRange(min=0), default=10, show_default=True,
              help="mlx-lm prompt cache: distinct KV caches kept (their tokens are not recounted).")
@click.option("--prompt-cache-bytes", type=_size, default=None, metavar="SIZE",
              help="mlx-lm prompt cache: most bytes kept (e.g. 4GiB).")
@click.option("--decode-concurrency", type=click.IntRange(min=1), default=32, show_default=True,
              help="Requests decoded together in one batch.")
@click.option("--prompt-concurrency", type=click.IntRange(min=1), default=8, show_default=True,
              help="Prompts prefilled together in one batch.")
@click.option("--prefill-step-size", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Prompt tokens per prefill forward.")
@click.option("--max-body-bytes", type=_size, default="8MiB", show_default=True, metavar="SIZE",
              help="Largest request body accepted (larger: 413).")
@click.option("--max-prompt-tokens", type=click.IntRange(min=1), default=None,
              help="Longest prompt accepted, in tokens after the chat template (longer: 400 naming prompt / "
                   "messages, before any prefill)  [default: the model's context length (max_position_embeddings)]")
@click.option("--max-connections", type=click.IntRange(min=1), default=64, show_default=True,
              help="Connections served at once; at the bound the one waiting longest on its client (idle, half "
                   "sent) is closed to make room, else more wait, unread, in the listen queue until one ends.")
@click.option("--request-timeout", type=FiniteFloat(min=0.0, min_open=True, max=86400.0, max_open=True),
              default=30.0, show_default=True, metavar="SECONDS",
              help="Time a request's line, headers and body may take to arrive (late: closed, 408 for a late body); "
                   "an idle connection is closed after as long.")
@click.option("--allowed-origins", default="", metavar="LIST",
              help="Comma-separated origins browsers may call from (CORS); none by default.")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]), default="WARNING",
              show_default=True, help="INFO logs every request.")
@dispatch_option
@generation_options
@friendly_errors
def command(allowed_origins, **kwargs):
    """Serve MODEL with mlx-lm's OpenAI-compatible server (/v1/chat/completions, /v1/completions, /v1/models,
    /health) while counting, for every token the model processes, which experts each MoE layer routes it to.
    The counts are read, saved and reset over REST (/v1/reap/stats, /info, /save, /reset), and experts are
    steered on or off at run time (/v1/reap/steer).

    \b
    Example (on the bundled model):
      mlx-fun serve --model data/tiny-moe --port 8080 --auto-save online.npz
      curl -s http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
          -d '{"messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 20}'
      curl -s http://127.0.0.1:8080/v1/reap/info

    Bounds against clients that hog it (a prompt over the limit is a 400 before any prefill; a request that has
    not arrived within the timeout is closed; connections past the bound wait, unread, in the listen queue):

    \b
      mlx-fun serve --model data/tiny-moe --max-prompt-tokens 2048 --max-connections 16 --request-timeout 10

    Ctrl+C (or SIGTERM) stops the server; with --auto-save the statistics are written atomically first, ready
    for `mlx-fun prune --saliency online.npz`.

    mlx-lm's generation options pass through as in smoke-test: --kv-bits / --kv-group-size / --quantized-kv-start,
    --max-kv-size (which mlx_lm.server lacks), --draft-model / --num-draft-tokens; with any of --kv-bits,
    --max-kv-size or --draft-model requests are served one at a time. Only the served model is counted: not the
    draft model, nor the drafted tokens it rejects. A model given as a repo id is served under that id.
    """
    from ..model.genopts import GenOptions
    from ..jobs import serve
    from ..serve.options import ServerOptions, StartupSteering

    origins = tuple(o.strip() for o in allowed_origins.split(",") if o.strip())
    server = take(kwargs, ServerOptions, allowed_origins=origins)
    steering = take(kwargs, StartupSteering)
    settings = run_settings(kwargs, progress=False)  # serve shows no progress bar
    generation = take(kwargs, GenOptions)
    show(serve.run(**kwargs, server=server, steering=steering, settings=settings, generation=generation,
                   log=lambda line: _echo(line, err=True)))


def _echo(line: str, *, err: bool = False) -> None:
    """``click.echo``, except that a reader gone away (``serve ... 2>&1 | head -1``) drops this and every later
    line of that stream: the stream is pointed at /dev/null, so neither the shutdown nor Python's exit (which
    flushes it) fails on it."""
    try:
        (echo_err if err else click.echo)(line)
    except BrokenPipeError:
        stream = sys.stderr if err else sys.stdout
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def show(result) -> None:
    saved = f"; statistics saved to {result.saved}" if result.saved is not None else ""
    _echo(f"Served {result.requests:,} requests, {result.tokens:,} tokens in {result.seconds:.0f} s{saved}")
