"""Running the click group in-process and checking the one-line error contract, shared by the CLI tests; running
the repository's scripts as the README does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from mlx_fun.cli import main

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    """Invoke ``mlx-fun ARGS…`` in-process; exceptions other than SystemExit propagate to the test."""
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def expect_error(result, *needles):
    """Exit code 2 and exactly one ``Error:`` line that contains every needle."""
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
    assert len(lines) == 1, result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


def script(name: str, *args, **kwargs) -> subprocess.CompletedProcess:
    """``python -m scripts.NAME ARGS…`` (``name`` such as ``"tools.prepare_dataset"``) in a child process, output
    captured as text; the repository root leads its ``PYTHONPATH``, so the checkout's ``scripts`` and ``mlx_fun``
    import whatever ``cwd`` is. Other keyword arguments (``env``, ``cwd``, ``timeout``) go to ``subprocess.run``."""
    env = dict(kwargs.pop("env", None) or os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", f"scripts.{name}", *map(str, args)], env=env, capture_output=True,
                          text=True, **kwargs)


def full_and_lazy(path):
    """``(model, adapter, lazy model, its adapter)``: ``path`` loaded whole, and loaded lazily (weights read from
    the files on first use) as a streamed run loads it: the two sides of every streamed == in-memory test."""
    from mlx_fun.adapters import get_adapter
    from mlx_fun.model.io import load_model

    model, _, config = load_model(path)
    lazy, _, lazy_config = load_model(path, lazy=True)
    return model, get_adapter(model, config), lazy, get_adapter(lazy, lazy_config)
