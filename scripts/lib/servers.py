"""A server under load: ``mlx_lm.server`` or ``mlx-fun serve`` as a child process on a free loopback port."""

from __future__ import annotations

import contextlib
import http.client
import socket
import subprocess
import sys
import time
from collections.abc import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server did not become healthy")


def server_command(kind: str, model: str, port: int, *serve_args: str) -> list[str]:
    """``kind`` "mlx-lm": ``python -m mlx_lm server``; otherwise ``python -m mlx_fun serve`` with ``serve_args``."""
    if kind == "mlx-lm":
        return [sys.executable, "-m", "mlx_lm", "server", "--model", model, "--port", str(port),
                "--log-level", "WARNING"]
    return [sys.executable, "-m", "mlx_fun", "serve", "--model", model, "--port", str(port), *serve_args]


@contextlib.contextmanager
def running(cmd: list[str], port: int, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """``cmd`` started (its output dropped) and healthy on ``port`` for the block; terminated at its end (killed
    after 60 s)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        wait_healthy(port, proc)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
