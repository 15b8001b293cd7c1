"""doctor: the MLX backend, device, BLAS and versions in use, plus a quick matmul benchmark."""

from __future__ import annotations

import platform
import sys
import time

import click


def _dist_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _backend(mx) -> str:
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and hasattr(cuda, "is_available") and cuda.is_available():
        return "cuda"
    return "cpu"


def matmul_gflops(n: int = 512, budget_s: float = 0.3) -> float:
    """Best float32 n³ matmul throughput on the default device within about ``budget_s`` seconds."""
    import mlx.core as mx

    a = mx.random.normal((n, n), dtype=mx.float32)
    b = mx.random.normal((n, n), dtype=mx.float32)
    mx.eval(a, b)
    mx.eval(a @ b)  # warm-up
    best = float("inf")
    start = time.perf_counter()
    for _ in range(50):
        t0 = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return 2 * n**3 / best / 1e9


@click.command("doctor")
def doctor():
    """Show the MLX backend, device, BLAS and versions, and measure a float32 matmul.

    \b
    Example:
      mlx-fun doctor
    """
    from .. import __version__
    from ..blas import blas_status

    click.echo(f"mlx-fun: {__version__}")
    click.echo(f"python: {platform.python_version()} ({sys.executable})")
    click.echo(f"platform: {platform.platform()}")
    try:
        import mlx.core as mx
    except Exception as exc:  # noqa: BLE001 - report, don't crash
        click.echo(f"mlx: cannot import ({exc})")
        click.echo(blas_status())
        raise SystemExit(1)
    click.echo(f"mlx: {getattr(mx, '__version__', _dist_version('mlx'))}")
    click.echo(f"mlx-lm: {_dist_version('mlx-lm')}")
    click.echo(f"default device: {mx.default_device()}")
    click.echo(f"backend: {_backend(mx)}")
    click.echo(blas_status())
    click.echo(f"matmul 512³ float32: {matmul_gflops():.1f} GFLOP/s")


COMMANDS = [doctor]
