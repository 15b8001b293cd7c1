"""Where mlx-fun keeps its own files outside any model: the cache root (the user dispatch table, the prepared BLAS);
and how a message names what a path given as a file actually is. A leaf module, so the dispatch table and the BLAS
set-up need not import the model I/O for it. And :func:`link_or_copy`, the one way a file is shared rather than
written again (a streamed run's spilled hidden states and its checkpoint)."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/mlx-fun`` (``~/.cache/mlx-fun`` when unset): the user dispatch table, the prepared BLAS."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlx-fun"


def mode_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, for a message: "a directory", "a character device", ..."""
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file"


def path_kind(path: str | os.PathLike) -> str:
    """What ``path`` is (links followed), for a message: :func:`mode_kind`, or "missing" / "a dangling link" /
    "unreadable (<reason>)" when it cannot be looked at."""
    try:
        return mode_kind(os.stat(path).st_mode)
    except FileNotFoundError:
        return "a dangling link" if os.path.islink(path) else "missing"
    except OSError as e:
        return f"unreadable ({e.strerror or e})"


def link_or_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """``dst`` becomes a hard link to ``src`` (no bytes written), a copy where a link cannot be made (another
    filesystem, a filesystem without links); an existing ``dst`` is replaced. Sharing is safe only where a file is
    never rewritten in place (replaced by a rename instead)."""
    Path(dst).unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
