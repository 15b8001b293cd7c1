"""OpenBLAS threads that give way when other processes want the CPU.

A multi-threaded OpenBLAS call splits its work across one thread per core and waits for all of them. When another
process holds a core, one part waits for the scheduler and the whole call with it; between calls, the idle threads
spin on cores the other process wants. On a shared 2-core machine that made `collect` 2-30x slower than with one
thread (and slower than with no fast BLAS at all), while on a quiet machine the threads are worth 15-40%
(python -m scripts.benchmarks.bench_collect --contended N).

:class:`Governor` watches how much CPU the *other* processes of the machine used in the last interval
(:mod:`mlx_fun.runtime.cpu_load`: ``/proc/stat`` minus this process's own ``/proc/self/stat`` time) and sets
OpenBLAS's thread count through its own ``openblas_set_num_threads``: all cores while the others use less than a
quarter of a core, one thread once they use half a core or more (in between: as it was). Small forwards run one thread
whatever the machine does: the hooked MoE call tells :func:`call_size` its token count, and up to :data:`SMALL_TOKENS`
tokens (a decode step) every product is too small to split, while an OpenBLAS worker woken by one of them spins on a
core that MLX's own threads need: greedy decode of the bundled model on 2 cores ran 1.39x faster on one thread
(``scripts/benchmarks/bench_decode.py``). It runs on a daemon thread, every :data:`INTERVAL` seconds, and only in a
process where mlx-fun preloaded OpenBLAS (:func:`mlx_fun.runtime.blas.maybe_reexec`) and the user did not set
``OPENBLAS_NUM_THREADS`` to a thread count (always respected; a value OpenBLAS ignores, such as ``abc``, is said on
stderr and governed as if unset).
``MLX_FUN_BLAS_GOVERNOR=0`` turns it off. Linux only (where the preload happens).

This module must not import ``mlx``.
"""

from __future__ import annotations

import ctypes
import os
import threading

from . import cpu_load

GOVERNOR_ENV = "MLX_FUN_BLAS_GOVERNOR"
#: seconds between two looks at the machine (the first one this soon after the start)
INTERVAL, FIRST_LOOK = 0.25, 0.05
#: the other processes' CPU use (in cores) from which OpenBLAS runs one thread, and below which it runs all again
BUSY, QUIET = 0.5, 0.25
#: forwards on at most this many tokens run OpenBLAS on one thread (:func:`call_size`)
SMALL_TOKENS = 16

_started: "Governor | None" = None


class Governor:
    """Sets OpenBLAS's threads from the other processes' CPU use (:meth:`decide`) and the size of the forwards
    (:meth:`small_calls`), on a daemon thread."""

    def __init__(self, set_threads, cores: int):
        self.set_threads, self.cores = set_threads, int(cores)
        self.threads = self.cores  # what OpenBLAS runs now
        self.wanted = self.cores  # what the machine's load asks for
        self.small = False  # the forwards are small (decode): one thread
        self.switches = 0
        self._last: cpu_load.Ticks | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def decide(self, others: float) -> int:
        """The thread count for ``others`` cores used by other processes (hysteresis between QUIET and BUSY)."""
        if others >= BUSY:
            return 1
        if others < QUIET:
            return self.cores
        return self.wanted

    def small_calls(self, small: bool) -> None:
        """The forwards are small (one thread) or not (what the machine's load asks for)."""
        if small != self.small:
            with self._lock:
                self.small = small
                self._apply()

    def _apply(self) -> None:
        want = 1 if self.small else self.wanted
        if want != self.threads:
            self.set_threads(want)
            self.threads, self.switches = want, self.switches + 1

    def sample(self) -> float | None:
        """Cores the other processes used since the last sample (None on the first, or without /proc)."""
        now = cpu_load.ticks()
        if now is None:
            return None
        last, self._last = self._last, now
        return None if last is None else cpu_load.others(last, now, os.cpu_count() or 1)

    def step(self) -> None:
        others = self.sample()
        if others is None:
            return
        with self._lock:
            self.wanted = self.decide(others)
            self._apply()

    def run(self) -> None:
        self.sample()  # the baseline, then a first look after FIRST_LOOK: a short command is governed too
        wait = FIRST_LOOK
        while not self._stop.wait(wait):
            wait = INTERVAL
            try:
                self.step()
            except Exception:  # noqa: BLE001 - never take the process down: stay as it is
                return

    def stop(self) -> None:
        self._stop.set()


def _openblas_setter():
    """(set_num_threads, current thread count) of the OpenBLAS mapped into this process, or None."""
    try:
        lib = ctypes.CDLL(None)
        setter, getter = lib.openblas_set_num_threads, lib.openblas_get_num_threads
    except (OSError, AttributeError):
        return None
    setter.argtypes, getter.restype = [ctypes.c_int], ctypes.c_int
    return setter, int(getter())


def call_size(tokens: int) -> None:
    """A forward on ``tokens`` tokens is about to run (the hooked MoE call says so at every call): up to
    :data:`SMALL_TOKENS`, OpenBLAS runs one thread. Nothing without a governor."""
    if _started is not None:
        _started.small_calls(tokens <= SMALL_TOKENS)


def _users_threads() -> bool:
    """Whether the user set ``OPENBLAS_NUM_THREADS`` to a thread count (left alone, then). A value that is no
    whole number >= 1 (OpenBLAS ignores it: one thread per core) is said in one line on stderr, and governed."""
    value = os.environ.get("OPENBLAS_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) >= 1:
        return True
    if value:
        import sys

        print(f"mlx-fun: warning: OPENBLAS_NUM_THREADS={value!r} is not a whole number of threads >= 1, so OpenBLAS "
              f"ignores it (one thread per core); mlx-fun's thread governor runs as if it were unset. Set a number "
              f"of threads to keep one, or unset it.", file=sys.stderr, flush=True)
    return False


def running() -> Governor | None:
    """The governor of this process, if it was started."""
    return _started


def start() -> Governor | None:
    """Start the governor once per process (see the module docstring for when); returns it, or None."""
    global _started
    if _started is not None:
        return _started
    from ..core.env import flag

    if _users_threads() or not flag(GOVERNOR_ENV, default=True):
        return None
    found = _openblas_setter()
    if found is None or found[1] < 2:
        return None
    setter, threads = found
    _started = Governor(setter, threads)
    threading.Thread(target=_started.run, name="mlx-fun-blas-governor", daemon=True).start()
    return _started


__all__ = ["BUSY", "FIRST_LOOK", "GOVERNOR_ENV", "Governor", "INTERVAL", "QUIET", "SMALL_TOKENS", "call_size",
           "running", "start"]
