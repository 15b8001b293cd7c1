"""``mlx-fun serve``: parses, calls :func:`mlx_fun.jobs.serve.run`, prints."""

from __future__ import annotations

import dataclasses
import os
import sys

import click

from ..jobs import serve
from .common import echo_err, friendly_errors
from .options import job_kwargs, job_options


@click.command("serve", short_help="OpenAI-compatible server that counts expert use and takes steering over REST.")
@job_options(serve.run, skip=("token_budget",))  # serve refuses it: mlx-lm's server prefills --prefill-step-size
@friendly_errors
def command(**kwargs):
    """Serve MODEL with mlx-lm's OpenAI-compatible server (/v1/chat/completions, /v1/completions, /v1/models,
    /health) while counting, for every token the model processes, which experts each MoE layer routes it to.
    The counts are read, saved and reset over REST (/v1/reap/stats, /info, /save, /reset), and experts are
    steered on or off at run time (/v1/reap/steer).

    \b
    Example (on the bundled model):
      mlx-fun serve --model data/tiny-moe --port 8080 --auto-save runs/online.npz
      curl -s http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
          -d '{"messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 20}'
      curl -s http://127.0.0.1:8080/v1/reap/info

    Bounds against clients that hog it (a prompt over the limit is a 400 before any prefill; a request that has
    not arrived within the timeout is closed; connections past the bound wait, unread, in the listen queue):

    \b
      mlx-fun serve --model data/tiny-moe --max-prompt-tokens 2048 --max-connections 16 --request-timeout 10

    Ctrl+C (or SIGTERM) stops the server; with --auto-save the statistics are written atomically first, ready
    for `mlx-fun prune --saliency runs/online.npz`.

    mlx-lm's generation options pass through as in smoke-test: --kv-bits / --kv-group-size / --quantized-kv-start,
    --max-kv-size (which mlx_lm.server lacks), --draft-model / --num-draft-tokens; with any of --kv-bits,
    --max-kv-size or --draft-model requests are served one at a time. Only the served model is counted: not the
    draft model, nor the drafted tokens it rejects. A model given as a repo id is served under that id.
    """
    kwargs = job_kwargs(serve.run, kwargs)
    if kwargs["server"].log_level is None:  # the command line logs warnings (a Python caller's logging is its own)
        kwargs["server"] = dataclasses.replace(kwargs["server"], log_level="WARNING")
    show(serve.run(**kwargs, log=lambda line: _echo(line, err=True)))


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
