"""mlx-fun's on/off environment switches (``MLX_FUN_DEBUG``, ``MLX_FUN_NO_FAST_BLAS``, ``MLX_FUN_EAGER_IMPORTS``,
``MLX_FUN_BLAS_GOVERNOR``), read one way. A leaf module: the BLAS set-up reads it before ``mlx`` is imported."""

from __future__ import annotations

import os
from typing import Mapping

OFF = ("0", "false", "no", "off")


def flag(name: str, default: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    """Switch ``name``: ``default`` when unset or blank, off for 0 / false / no / off (any case), else on."""
    value = (os.environ if environ is None else environ).get(name, "").strip().lower()
    return default if not value else value not in OFF


__all__ = ["OFF", "flag"]
