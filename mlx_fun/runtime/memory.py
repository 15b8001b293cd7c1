"""How much memory this process can still use, and how much a model's weights take: what ``collect`` compares to
decide whether to stream the model's layers (``--stream-layers``, automatic by default).

:func:`available_bytes` is the least of the machine's available memory (Linux ``MemAvailable``; macOS the free,
inactive, speculative and purgeable pages of ``vm_stat``, else ``hw.memsize``) and the room left under this
process's cgroup limit (v2 ``memory.max`` − ``memory.current``, v1 ``memory.limit_in_bytes`` −
``memory.usage_in_bytes``); None where none of these can be read."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def meminfo_available(path: Path = Path("/proc/meminfo")) -> int | None:
    """Linux ``MemAvailable`` in bytes."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """This process's memory cgroup directories, its own first, then each parent up to the hierarchy's root, from
    ``/proc/self/cgroup`` (v2: the ``0::/path`` line where ``root`` is the unified hierarchy; v1: the ``memory``
    controller's line under ``root/memory``). A limit anywhere on that path applies to the process."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    dirs = []
    for line in lines:
        _hier, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "" and (root / "cgroup.controllers").exists():
            base = root
        elif "memory" in controllers.split(","):
            base = root / "memory"
        else:
            continue
        here = base / path.strip().lstrip("/")
        dirs += [here, *[d for d in here.parents if d == base or base in d.parents]]
    return dirs or [root, root / "memory"]


def cgroup_room(root: Path = CGROUP, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """The least room (limit minus usage) of this process's memory cgroup and its parents (v2 ``memory.max`` −
    ``memory.current``, v1 ``memory.limit_in_bytes`` − ``memory.usage_in_bytes``); None without a limit. Its own
    cgroup may be below the root: a container without a cgroup namespace, a systemd slice, ``cgexec``."""
    rooms = []
    for d in _cgroup_dirs(root, proc_cgroup):
        for limit, usage in (("memory.max", "memory.current"), ("memory.limit_in_bytes", "memory.usage_in_bytes")):
            cap, used = _read_int(d / limit), _read_int(d / usage)
            if cap is not None and used is not None and cap < 1 << 60:  # v1's "no limit" is a huge number
                rooms.append(max(cap - used, 0))
    return min(rooms) if rooms else None


def _macos_available() -> int | None:
    try:
        out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5).stdout
        page = int(re.search(r"page size of (\d+)", out).group(1))
        pages = sum(int(m.group(2)) for m in re.finditer(r"Pages (free|inactive|speculative|purgeable):\s+(\d+)", out))
        return pages * page
    except (OSError, ValueError, AttributeError, subprocess.SubprocessError):
        pass
    try:
        out = subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True, timeout=5).stdout
        return int(out.strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def available_bytes() -> int | None:
    """The memory this process can still use (see the module docstring), or None when unknown."""
    found = [cgroup_room()]
    found.append(_macos_available() if sys.platform == "darwin" else meminfo_available())
    known = [n for n in found if n is not None]
    return min(known) if known else None


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (``getrusage``: kilobytes on Linux, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def device_peak_bytes() -> int | None:
    """MLX's peak allocation on a GPU (Metal's unified memory, which the resident set may not count; a CUDA card's
    memory, which it never does) when arrays run on one, else None (on the CPU they are in the resident set)."""
    import mlx.core as mx

    if mx.default_device() != mx.gpu:
        return None
    return int(mx.get_peak_memory())


def weight_bytes(model_dir: str | os.PathLike) -> int:
    """The bytes of a model directory's weights: the sum of its ``*.safetensors`` files."""
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


__all__ = ["available_bytes", "cgroup_room", "device_peak_bytes", "meminfo_available", "peak_rss_bytes",
           "weight_bytes"]
