"""How much of the machine the *other* processes use: the one reading of it, for the OpenBLAS thread governor
(:mod:`mlx_fun.runtime.blas_threads`) and for ``tune-dispatch``, whose timings beside other work are noisy.

On Linux, :func:`ticks` reads the CPU ticks of the whole machine (``/proc/stat``: busy — user, nice, system, irq,
softirq, steal: time a hypervisor gave to other guests counts — and all) and this process's own (``/proc/self/stat``,
every thread); :func:`others` turns two readings into the cores the other processes used between them. Elsewhere
(macOS) :class:`Watch` takes the 1-minute load average less this process's own rate over its window.

:func:`busy` is ``tune-dispatch``'s decision: other processes used more than :func:`threshold` cores (a quarter of
them, at least half a core: a second program spinning on one core of a 2-core machine is busy, a build on 3 of 16
is not).

This module must not import ``mlx`` (the governor runs before it is imported).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


def threshold(cores: int) -> float:
    """The most cores other processes may use before the machine counts as busy: a quarter, at least half a core."""
    return max(0.5, cores / 4)


def busy(others: float, cores: int) -> bool:
    """Other processes used more than :func:`threshold` of the machine's ``cores`` (``others``: in cores)."""
    return others > threshold(cores)


@dataclass(frozen=True)
class Ticks:
    """One reading: the machine's busy and total CPU ticks since boot, and this process's own busy ticks."""

    busy: int
    total: int
    own: int


def machine_ticks() -> tuple[int, int] | None:
    """(busy ticks, all ticks) of every CPU since boot, from ``/proc/stat``'s first line."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 4:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    return total - idle, total


def own_ticks() -> int | None:
    """This process's user + system ticks, all threads (``/proc/self/stat`` fields 14 and 15)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            rest = f.read().rsplit(b")", 1)[1].split()
        return int(rest[11]) + int(rest[12])
    except (OSError, ValueError, IndexError):
        return None


def ticks() -> Ticks | None:
    """A reading of :func:`machine_ticks` and :func:`own_ticks`, or None without ``/proc``."""
    machine, own = machine_ticks(), own_ticks()
    return None if machine is None or own is None else Ticks(machine[0], machine[1], own)


def others(before: Ticks, after: Ticks, cores: int) -> float | None:
    """Cores the other processes used between two readings (None when no tick passed)."""
    if after.total <= before.total:
        return None
    work = (after.busy - before.busy) - (after.own - before.own)
    return max(0.0, work / (after.total - before.total) * cores)


@dataclass(frozen=True)
class Load:
    """Other processes' work over a window: ``others`` cores' worth out of ``cores``, over ``seconds``."""

    others: float
    cores: int
    seconds: float

    @property
    def busy(self) -> bool:
        return busy(self.others, self.cores)

    def describe(self) -> str:
        return f"other processes used {self.others:.1f} of its {self.cores} cores"


class Watch:
    """Started when made; :meth:`load` is the other processes' work since then."""

    def __init__(self):
        self._wall, self._ticks, self._cpu = time.monotonic(), ticks(), _own_seconds()

    def load(self) -> Load:
        wall = max(time.monotonic() - self._wall, 1e-6)
        cores = os.cpu_count() or 1
        now = ticks()
        used = None if self._ticks is None or now is None else others(self._ticks, now, cores)
        if used is None:  # no /proc (macOS), or too short a window: the load average less this process's rate
            try:
                average = os.getloadavg()[0]
            except (AttributeError, OSError):
                average = 0.0
            used = max(average - (_own_seconds() - self._cpu) / wall, 0.0)
        return Load(used, cores, wall)


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


_STARTED: Watch | None = None


def started() -> Watch:
    """The watch opened when this command started (:mod:`mlx_fun.launcher` opens it first thing), else now."""
    global _STARTED
    if _STARTED is None:
        _STARTED = Watch()
    return _STARTED


def sample(seconds: float = 0.5, *, since: Watch | None = None) -> Load:
    """Other processes' work over a window of at least ``seconds``: from ``since`` (a watch started when the
    command started, so its own start-up counts towards the window) or from now; this process sleeps only for what
    is left of the window."""
    watch = since or Watch()
    time.sleep(max(0.0, seconds - (time.monotonic() - watch._wall)))
    return watch.load()


__all__ = ["Load", "Ticks", "Watch", "busy", "machine_ticks", "others", "own_ticks", "sample", "started", "threshold",
           "ticks"]
