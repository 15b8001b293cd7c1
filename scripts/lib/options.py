"""Option blocks that several scripts take, each written once (same names, defaults and help everywhere)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .paths import BUNDLED, CHAT, REPORTS, SAFETY


def add_model(p: argparse.ArgumentParser, *, default: Path = BUNDLED, help: str | None = None) -> None:
    """``--model``: a model directory, by default the bundled base model."""
    p.add_argument("--model", default=str(default), help=help)


def add_load(p: argparse.ArgumentParser, *, clients: int, requests: int, max_tokens: int | None = None,
             time_limit: float | None = None) -> None:
    """A load against a server (``mlx_fun.testing.loadtest.run_load``): ``--clients`` concurrent clients ×
    ``--requests`` requests each, and where given ``--max-tokens`` per completion and ``--time-limit``."""
    p.add_argument("--clients", type=int, default=clients)
    p.add_argument("--requests", type=int, default=requests)
    if max_tokens is not None:
        p.add_argument("--max-tokens", type=int, default=max_tokens)
    if time_limit is not None:
        p.add_argument("--time-limit", type=float, default=time_limit,
                       help="seconds; requests not started by then fail")


def add_chat_data(p: argparse.ArgumentParser) -> None:
    """``--model`` (the bundled chat model) and ``--data`` (its prompt sets, ``data/safety``)."""
    add_model(p, default=CHAT)
    p.add_argument("--data", default=str(SAFETY))


def add_report(p: argparse.ArgumentParser, name: str) -> None:
    """``--output``: the markdown report the script writes, by default ``docs/benchmarks/<name>``."""
    p.add_argument("--output", default=str(REPORTS / name))


def add_build(p: argparse.ArgumentParser) -> None:
    """``--build JSON``: a random qwen3_moe made by ``mlx_fun.testing.tiny.make_tiny_model`` instead of --model."""
    p.add_argument("--build", default=None, help="JSON: make_tiny_model keywords for a random qwen3_moe")
