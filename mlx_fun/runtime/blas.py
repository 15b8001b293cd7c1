"""Fast BLAS for MLX's CPU backend on Linux.

The ``mlx[cpu]`` wheel on Linux bundles the reference (netlib) BLAS: a 1024³ float32 matmul runs at
~5 GFLOP/s. Preloading OpenBLAS makes MLX's ``cblas_*``/LAPACK calls resolve to it instead: ~150-230 GFLOP/s
on the same 2-core machine. It comes from PyPI (``scipy-openblas32``, a Linux dependency of mlx-fun, made
preloadable by :mod:`mlx_fun.runtime.openblas_wheel`) or from the system (Debian/Ubuntu: ``libopenblas0-pthread``,
preferred when installed). ``LD_PRELOAD`` is only honoured when a process starts, so :func:`maybe_reexec`
re-executes the current process once, with the library preloaded, before ``mlx`` is imported. The
``mlx-fun`` console script (:mod:`mlx_fun.launcher`) and the benchmark scripts call it.

Environment:

- ``MLX_FUN_NO_FAST_BLAS=1``: never preload / re-exec.
- ``MLX_FUN_BLAS=/path/lib.so``: the library to preload (default: the first OpenBLAS found); ``wheel`` (any case):
  the ``scipy-openblas32`` wheel's OpenBLAS even when a system one is installed.
- ``MLX_FUN_BLAS_REEXEC=1``: set by the re-exec (inherited by children); no further re-exec is tried.
- ``OPENBLAS_NUM_THREADS``: left to OpenBLAS (all cores) unless you set it; see
  :data:`DEFAULT_OPENBLAS_THREADS` for why no default is imposed. Unset, :mod:`mlx_fun.runtime.blas_threads` lowers it
  to one thread while other processes use the CPU (``MLX_FUN_BLAS_GOVERNOR=0``: off).

This module must not import ``mlx`` at import time (it runs before ``mlx`` may be imported).
"""

from __future__ import annotations

import os
import sys

DISABLE_ENV = "MLX_FUN_NO_FAST_BLAS"
LIBRARY_ENV = "MLX_FUN_BLAS"
MARKER_ENV = "MLX_FUN_BLAS_REEXEC"

CUDA_DISTRIBUTIONS = ("mlx-cuda-12", "mlx-cuda-13", "mlx-cuda")

# OPENBLAS_NUM_THREADS to setdefault() before the re-exec; None = leave OpenBLAS's default (one thread
# per core). Measured on a 2-core x86_64 Linux box, mlx 0.32.4, OpenBLAS 0.3.21 (pthread), best of N:
#   qwen3_moe float32 forward (hidden 512, 64 experts top-8, 4 layers, 512 tokens), 6 runs each:
#       unset 1.82-1.93 s, 1 thread 1.83-1.96 s, 2 threads 1.80-1.92 s  (reference BLAS: 5.2 s)
#   1024³ float32 matmul: unset 67-231 GFLOP/s, 1 thread 115-119, 2 threads 106-239  (reference: ~7)
#   gather_mm 4096 rows x (512 -> 256), 64 experts: 130-180 ms at every setting (reference: 264 ms)
#   the test suite (tiny models): same wall time either way; 1 thread only saves system CPU time
# A single thread does not help the forward (within noise, if anything slower) and halves large
# matmuls, so no default is imposed; a user's OPENBLAS_NUM_THREADS is always respected.
DEFAULT_OPENBLAS_THREADS: int | None = None

REFERENCE_PREFIX = "blas: reference BLAS of the mlx[cpu] wheel (slow)"
REFERENCE_MESSAGE = (
    f"{REFERENCE_PREFIX}: `pip install scipy-openblas32` (mlx-fun's Linux dependency) or Debian's "
    "libopenblas0-pthread give 25-40x faster CPU matmuls"
)


def _platform() -> str:
    """``sys.platform`` (a function so tests can fake it)."""
    return sys.platform


def _is_linux() -> bool:
    return _platform().startswith("linux")


def _multiarch() -> str:
    import platform

    machine = platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    return f"{machine}-linux-gnu"


def _candidates() -> list[str]:
    """Where distributions put OpenBLAS, most preferred first (pthread build before OpenMP/serial)."""
    arch = _multiarch()
    dirs = [f"/usr/lib/{arch}", "/usr/lib64", "/usr/lib", "/usr/local/lib"]
    paths = []
    for variant in ("openblas-pthread", "openblas-openmp", "openblas-serial"):
        paths.append(f"/usr/lib/{arch}/{variant}/libopenblas.so.0")
    for d in dirs:
        paths.append(f"{d}/libopenblas.so.0")
        paths.append(f"{d}/libopenblasp.so.0")  # Fedora's pthread build
    return paths


def _loads(path: str) -> str | None:
    """None if ``path`` can be loaded and exports ``cblas_sgemm``; else why not. Checked before it is preloaded:
    a library with a missing dependency in ``LD_PRELOAD`` makes the dynamic loader abort every command (exit 127)."""
    import ctypes

    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        return f"cannot be loaded ({' '.join(str(e).split())})"
    return None if hasattr(lib, "cblas_sgemm") else "does not export cblas_sgemm (not a BLAS)"


def _not_a_library(path: str) -> str | None:
    """None when ``path`` is a regular file (a library to try); else what it is, for the warning."""
    from ..core.paths import path_kind

    kind = path_kind(path)
    if kind == "a regular file":
        return None
    takes = f"{LIBRARY_ENV} takes the path of a BLAS library file (libopenblas.so.0, ...) or `wheel`"
    if kind == "missing":
        return f"does not exist ({takes})"
    return f"is {kind}, not a library file ({takes})"


def find_fast_blas(notes: list[str] | None = None, *, check: bool = False) -> str | None:
    """Path of a fast BLAS to preload, or None (not Linux, or none usable).

    In order: ``MLX_FUN_BLAS`` (a library that is missing, or with ``check`` does not load, is skipped with a
    line in ``notes``), a system OpenBLAS (Debian's ``libopenblas0-pthread`` and the like), then the
    ``scipy-openblas32`` wheel that mlx-fun installs on Linux, made usable by
    :func:`mlx_fun.runtime.openblas_wheel.prepared_library` (once, in ``~/.cache/mlx-fun/blas``). ``check`` loads each
    candidate into this process to prove it loads: only for the process about to re-exec.
    """
    if not _is_linux():
        return None
    notes = [] if notes is None else notes
    explicit = os.environ.get(LIBRARY_ENV, "").strip()
    if explicit.lower() == "wheel":
        explicit = ""
        candidates: list[str] = []
    else:
        candidates = _candidates()
    if explicit:
        problem = _not_a_library(explicit) or (_loads(explicit) if check else None)
        if problem is None:
            return explicit
        notes.append(f"{LIBRARY_ENV}={explicit} {problem}; using the next fast BLAS found instead.")
    for path in candidates:
        if os.path.isfile(path):
            problem = _loads(path) if check else None
            if problem is None:
                return path
            notes.append(f"{path} {problem}; skipped.")
    from .openblas_wheel import prepared_library

    library, problem = prepared_library()
    if library is None:
        notes.append(f"no fast BLAS: {problem}.")
        return None
    return str(library)


def cuda_backend_installed() -> bool:
    """Whether an MLX CUDA backend distribution is installed (checked without importing mlx)."""
    from importlib import metadata

    for name in CUDA_DISTRIBUTIONS:
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        except Exception:  # a broken dist-info should not break the CLI
            continue
        return True
    return False


def _disabled(environ=None) -> bool:
    from ..core.env import flag

    return flag(DISABLE_ENV, environ=environ)


def _is_blas_name(path: str, library: str | None) -> bool:
    base = os.path.basename(path)
    if base.startswith("libopenblas"):
        return True
    if library:
        try:
            return os.path.realpath(path) == os.path.realpath(library)
        except OSError:
            return False
    return False


def _preload_entries(value: str) -> list[str]:
    return [p for p in value.replace(":", " ").split() if p]


def _mapped_blas(library: str | None = None) -> str | None:
    """The fast BLAS actually mapped into this process (from ``/proc/self/maps``), or None."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return None
    wanted = os.path.realpath(library) if library else None
    fallback = None
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        path = parts[5].strip()
        if wanted and path == wanted:
            return path
        if fallback is None and os.path.basename(path).startswith("libopenblas"):
            fallback = path
    return fallback


def _reexec_env(environ, modules, library: str | None, cuda: bool) -> dict | None:
    """The environment to re-exec with, or None when no re-exec should happen (pure; for tests)."""
    if not _is_linux() or _disabled(environ) or cuda or not library:
        return None
    if environ.get(MARKER_ENV):
        return None  # one attempt only, even if the preload did not take
    if "mlx" in modules or "mlx.core" in modules:
        return None  # too late: libmlx and its BLAS are already loaded
    existing = environ.get("LD_PRELOAD", "")
    if any(_is_blas_name(p, library) for p in _preload_entries(existing)):
        return None
    env = dict(environ)
    env["LD_PRELOAD"] = f"{library}:{existing}" if existing.strip() else library
    env[MARKER_ENV] = "1"
    if DEFAULT_OPENBLAS_THREADS is not None and os.path.basename(library).startswith("libopenblas"):
        env.setdefault("OPENBLAS_NUM_THREADS", str(DEFAULT_OPENBLAS_THREADS))
    local = local_ranks(environ)
    if local > 1:  # mlx.launch put several ranks on this host: share the cores instead of oversubscribing them
        env.setdefault("OPENBLAS_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // local)))
    return env


def local_ranks(environ) -> int:
    """How many ranks ``mlx.launch`` (ring backend: ``MLX_HOSTFILE`` is a JSON list of ``["ip:port", ...]`` per
    rank) runs on this host; 0 when not launched or the file is not that format.

    Measured (2-core Linux, bundled model, ``python -m scripts.benchmarks.bench_distributed --samples 128``): two
    ranks that each keep OpenBLAS's default of one thread per core collect 3.5x slower than one process (OpenBLAS threads spin
    on the shared cores); with the cores divided, as here, they run as fast as one process."""
    import socket

    from ..core.json_input import read

    path = environ.get("MLX_HOSTFILE")
    try:
        hosts = [str(entry).rsplit(":", 1)[0] for rank in read(path, error=ValueError) for entry in rank[:1]]
        mine = {"127.0.0.1", "localhost", "::1", socket.gethostname()}
        mine.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except (TypeError, OSError, ValueError, IndexError):
        return 0
    return sum(h in mine for h in hosts)


def maybe_reexec() -> None:
    """Re-exec this process once with a fast BLAS in ``LD_PRELOAD``; a no-op when not useful.

    Only on Linux, when not disabled (``MLX_FUN_NO_FAST_BLAS=1``), no CUDA backend is installed, a
    fast BLAS is found, loads, and is not already preloaded, no re-exec was tried before
    (``MLX_FUN_BLAS_REEXEC``) and ``mlx`` is not imported yet. If the exec fails, the process goes on with the
    slow BLAS. Problems with ``MLX_FUN_BLAS`` are reported on stderr, once. In the re-executed process it starts
    :mod:`mlx_fun.runtime.blas_threads`' governor (OpenBLAS's threads give way to other processes).
    """
    notes: list[str] = []
    try:
        if not _is_linux() or _disabled():
            return
        if os.environ.get(MARKER_ENV):  # the re-executed process (or one that gave up): govern the threads
            from .blas_threads import start

            start()
            return
        if "mlx" in sys.modules or "mlx.core" in sys.modules:
            return
        argv = list(getattr(sys, "orig_argv", None) or [])
        if not argv or not sys.executable or sys.argv[:1] in ([""], ["-"]):
            return  # interactive or script from stdin: cannot be replayed
        if cuda_backend_installed() or _mapped_blas():
            return  # CUDA, or a BLAS preloaded by hand (checked before find_fast_blas loads candidates)
        library = find_fast_blas(notes, check=True)
        if not library:
            return
        env = _reexec_env(os.environ, sys.modules, library, False)
        if env is None:
            return
    except Exception:
        return
    finally:
        for note in notes:
            print(f"mlx-fun: warning: {note}", file=sys.stderr, flush=True)
    changed = {k: v for k, v in env.items() if os.environ.get(k) != v}
    saved = {k: os.environ.get(k) for k in changed}
    try:
        os.environ.update(changed)  # execv passes os.environ on
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os.execv(sys.executable, argv)
    except Exception:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        os.environ[MARKER_ENV] = "1"  # never try again in this process tree


def _openblas_threads(path: str) -> int | None:
    """Threads the mapped OpenBLAS uses (its ``openblas_get_num_threads``), or None."""
    try:
        import ctypes

        lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 4) | ctypes.RTLD_GLOBAL)
        return int(lib.openblas_get_num_threads())
    except Exception:
        return None


def blas_status() -> str:
    """One human-readable line on the BLAS MLX's CPU backend uses in this process."""
    plat = _platform()
    if plat == "darwin":
        return "blas: not needed (macOS Accelerate)"
    if not plat.startswith("linux"):
        return f"blas: no fast-BLAS preload on {plat}"
    library = find_fast_blas()
    mapped = _mapped_blas(library)
    if mapped:
        name = "OpenBLAS" if os.path.basename(mapped).startswith("libopenblas") else "BLAS"
        threads_env = os.environ.get("OPENBLAS_NUM_THREADS", "unset")
        threads = _openblas_threads(mapped) if name == "OpenBLAS" else None
        detail = f"OPENBLAS_NUM_THREADS={threads_env}" + (f", {threads} threads" if threads else "")
        from .blas_threads import running

        if running() is not None:
            detail += ", one while other processes use the CPU"
        return f"blas: {name} preloaded ({mapped}, {detail})"
    if _disabled():
        return f"blas: disabled by {DISABLE_ENV}={os.environ.get(DISABLE_ENV)}"
    if cuda_backend_installed():
        return "blas: not needed (CUDA backend)"
    if library:
        return (
            f"{REFERENCE_PREFIX}: {library} is installed but not preloaded; "
            f"run through `mlx-fun` or set LD_PRELOAD={library}"
        )
    return REFERENCE_MESSAGE
