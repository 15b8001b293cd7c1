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


def python_path(*first) -> str:
    """A child's ``PYTHONPATH``: ``first`` (stub packages), then the repository root, then this process's own
    ``PYTHONPATH`` (kept: where mlx or mlx-lm is installed by ``PYTHONPATH``, as on the lent GPU machines, a child
    that lost it could not import them)."""
    return os.pathsep.join(filter(None, [*map(str, first), str(ROOT), os.environ.get("PYTHONPATH")]))


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


#: Python that makes a child process SIGKILL itself once a streamed run's checkpoint is saved at layer (or phase)
#: ``$KILL_AFTER`` (a save after every layer, however quick; ``$ROOM``, if set: the memory left); a test appends
#: what the child runs (:data:`CLI_MAIN`, or a job call)
KILLED_AFTER_SAVE = """
import json, os, signal, sys
import mlx_fun.observe.checkpoint as c
import mlx_fun.runtime.memory as m
if os.environ.get("ROOM"):
    m.available_bytes = lambda: int(os.environ["ROOM"])
real = c.StreamCheckpoint.save
def save(self, layer, *a, **k):
    real(self, layer, *a, **k)
    if layer == int(os.environ.get("KILL_AFTER", "-1")):
        os.kill(os.getpid(), signal.SIGKILL)
c.StreamCheckpoint.save = save
c.StreamCheckpoint.EVERY = 0  # a save after every layer, however quick (the policy: test_checkpoint_policy)
"""
CLI_MAIN = 'from mlx_fun.cli import main\nmain(sys.argv[1:], prog_name="mlx-fun")\n'


def interrupting_checkpoint(path, job: str, stop_after: int | None = None):
    """A :class:`mlx_fun.observe.checkpoint.StreamCheckpoint` at ``path`` that saves after every layer and raises
    ``KeyboardInterrupt`` (Ctrl-C, in-process) once layer ``stop_after`` is saved."""
    from mlx_fun.observe.checkpoint import StreamCheckpoint

    ck = StreamCheckpoint(path, {"run": 1}, job=job)
    ck.EVERY, real = 0, ck.save

    def save(layer, *a, **k):
        real(layer, *a, **k)
        if layer == stop_after:
            raise KeyboardInterrupt

    ck.save = save
    return ck

