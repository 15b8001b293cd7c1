"""Where mlx-fun keeps its own files outside any model: the cache root (the user dispatch table, the prepared BLAS).
A leaf module, so the dispatch table and the BLAS set-up need not import the model I/O for it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/mlx-fun`` (``~/.cache/mlx-fun`` when unset): the user dispatch table, the prepared BLAS."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlx-fun"
