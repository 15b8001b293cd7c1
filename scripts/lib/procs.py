"""Child processes of the scripts: the checkout importable in them, and busy processes to contend with."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

from .paths import ROOT


def root_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with the repository root first on ``PYTHONPATH``: a child
    ``python -c`` / ``python -m mlx_fun`` then imports this checkout's ``mlx_fun`` and ``scripts``."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@contextlib.contextmanager
def busy_processes(n: int, *, settle: float = 0.0) -> Iterator[list[subprocess.Popen]]:
    """``n`` processes spinning on the CPU while the block runs (``settle`` seconds given them to start when there
    are any), killed and waited for at its end."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(0, n))]
    try:
        if procs and settle:
            time.sleep(settle)
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
