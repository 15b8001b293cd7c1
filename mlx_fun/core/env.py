"""mlx-fun's on/off environment switches (``MLX_FUN_DEBUG``, ``MLX_FUN_NO_FAST_BLAS``, ``MLX_FUN_EAGER_IMPORTS``,
``MLX_FUN_BLAS_GOVERNOR``), read one way, and MLX's own float32 switch as mlx-fun sets it (:func:`keep_float32`). A
leaf module: the BLAS set-up reads it before ``mlx`` is imported."""

from __future__ import annotations

import os
from typing import Mapping

OFF = ("0", "false", "no", "off")


def flag(name: str, default: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    """Switch ``name``: ``default`` when unset or blank, off for 0 / false / no / off (any case), else on."""
    value = (os.environ if environ is None else environ).get(name, "").strip().lower()
    return default if not value else value not in OFF


#: MLX's switch for float32 matmuls: 1 (MLX's default) lets CUDA GPUs and Apple M5's neural accelerators run them as
#: TF32 (about 3 significant digits per product), 0 keeps them in float32
TF32 = "MLX_ENABLE_TF32"


def keep_float32(environ=None) -> str:
    """Keep float32 matmuls in float32 unless the user chose (``MLX_ENABLE_TF32`` set, to anything): what the console
    does before ``mlx`` is imported, since MLX reads the switch once. With TF32, 0.03% of the bundled model's
    routing choices flip on an H200 and REAP no longer matches its float32 reference (docs/benchmarks/parity.md);
    models in bfloat16, float16 or quantized never run float32 matmuls, so their speed does not change. Returns
    the value in effect."""
    environ = os.environ if environ is None else environ
    return environ.setdefault(TF32, "0")


__all__ = ["OFF", "TF32", "flag", "keep_float32"]
