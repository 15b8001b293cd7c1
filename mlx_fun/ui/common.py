"""What every tab shares: the :class:`Context` (server client, data directory) and the one-line error guard."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from .client import ServerClient, ServerError, one_line

#: (label, metric) pairs of every metric selector; the metric names are saliency.METRICS'
METRICS = [("Frequency", "freq"), ("Weighted frequency", "weighted_freq"), ("REAP", "reap"), ("EAN", "ean")]
log = logging.getLogger("mlx_fun.ui")


@dataclass
class Context:
    client: ServerClient
    data_dir: Path  # the UI's own files (saliency files it compares, exports it writes); the server has its own

    def npz_files(self) -> list[str]:
        """The ``.npz`` files in the data directory and its sub-directories (one level), relative, sorted; hidden
        entries never (the writer's temps and locks, ``.<name>.mlxfun-*.tmp.npz`` / ``.<name>.lock``, are hidden)."""
        root = self.data_dir
        return sorted({p.relative_to(root).as_posix() for pat in ("*.npz", "*/*.npz") for p in root.glob(pat)
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)})


def problem(e: BaseException) -> str:
    """The one line a tab shows for a failure (never a stack trace; an unexpected one is logged in the terminal)."""
    if isinstance(e, (ServerError, UserError)):
        return f"⚠️ {one_line(e)}"
    debug = os.environ.get("MLX_FUN_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")
    log.warning("dashboard: unexpected %s: %s", type(e).__name__, one_line(e), exc_info=e if debug else None)
    return f"⚠️ unexpected {type(e).__name__}: {one_line(e)[:200]}"


def guarded(n_outputs: int, status: int):
    """Wrap a handler returning ``n_outputs`` values so that any failure leaves the other outputs as they are and
    puts :func:`problem`'s line in output ``status``."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args):
            import gradio as gr

            try:
                return fn(*args)
            except Exception as e:  # noqa: BLE001 - the page shows one line, never a stack trace
                out = [gr.update() for _ in range(n_outputs)]
                out[status] = problem(e)
                return tuple(out) if n_outputs > 1 else out[0]

        return run

    return wrap
