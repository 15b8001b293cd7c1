"""The ``doctor`` job: the MLX backend, device, BLAS and versions in use (mlx / mlx-lm against the ranges mlx-fun
is tested with, and whether the installed mlx-lm has every private name mlx-fun uses), a measured matmul speed, and
the model types mlx-fun serves (with any MoE type of the installed mlx-lm it does not know); with ``model``, how each
of its expert shapes is dispatched (the full line of table entries that the model commands say in words)."""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path
from typing import Annotated

from ..core.options import Opt
from .common import job


def backend(mx) -> str:
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


@job
def run(*, model: Annotated[str | Path | None, Opt(
        "Also show how each expert shape of this MoE model (a local directory or a Hugging Face repo id) is dispatched "
        "here: the table entry it uses, as the other commands say it in words. Nothing is run.")] = None,
        ) -> dict[str, str]:
    """Ordered facts (name → text); ``mlx`` says why when MLX cannot be imported (and nothing is measured);
    ``mlx-lm compat`` starts with ``MISSING`` when the installed mlx-lm lacks a private name a feature needs;
    ``dispatch`` (with ``model``): :meth:`mlx_fun.dispatch.experts.DispatchReport.summary` of the model, loaded
    lazily (no weight is read) with the default tables."""
    from .. import __version__, mlx_lm_compat
    from ..runtime.blas import blas_status
    from .common import check_moe

    checked = None if model is None else check_moe(model)  # a wrong --model fails before anything is measured

    facts = {"mlx-fun": __version__, "python": f"{platform.python_version()} ({sys.executable})",
             "platform": platform.platform()}
    try:
        import mlx.core as mx
    except Exception as exc:  # noqa: BLE001 - report, don't crash
        facts["mlx"] = f"cannot import ({exc})"
        facts["mlx-lm"] = mlx_lm_compat.version_line("mlx-lm", mlx_lm_compat.MLX_LM_RANGE, tested=True)
        facts["blas"] = blas_status()
        return facts
    facts.update(mlx_lm_compat.report())
    facts.update({"default device": str(mx.default_device()), "backend": backend(mx), "blas": blas_status(),
                  "float32 matmuls": float32_matmuls(), "matmul 512³ float32": f"{matmul_gflops():.1f} GFLOP/s",
                  "dispatch table": dispatch_table(),
                  "model types": model_types()})
    if model is not None:
        facts["dispatch"] = model_dispatch(model, checked)
    return facts


def float32_matmuls() -> str:
    """Whether MLX may run float32 matmuls as TF32 here (:func:`mlx_fun.core.env.keep_float32`)."""
    from ..core import env

    value = os.environ.get(env.TF32)
    if value is None:
        return f"TF32 allowed where the hardware has it (MLX's default; the mlx-fun console sets {env.TF32}=0)"
    if value.strip() == "0":
        return f"full float32 ({env.TF32}=0)"
    return f"TF32 allowed where the hardware has it ({env.TF32}={value})"


def model_dispatch(model, checked: tuple[dict, type]) -> str:
    """The full dispatch line of ``model`` (each expert shape: the table entry it uses and how it was found;
    ``checked``: what :func:`mlx_fun.jobs.common.check_moe` found)."""
    from ..settings import RunSettings
    from .common import load_moe

    mdl = load_moe(model, lazy=True, checked=checked, tokenizer=False)[0]
    return RunSettings().apply(mdl).summary().removeprefix("dispatch: ")


def dispatch_table() -> str:
    """How many measured cut-off entries the dispatch has for this backend (shipped + user table), or the line
    suggesting ``tune-dispatch`` when it has none."""
    from ..dispatch.table import backend_name, has_backend, load_table, untuned_line, user_table_path

    backend = backend_name()
    try:
        table = load_table()
    except ValueError as e:
        return f"unreadable: {e}"
    if not has_backend(table, backend):
        return untuned_line(backend)
    n = sum(e.backend == backend for e in table.entries)
    user = user_table_path()
    return f"{n} measured entr{'y' if n == 1 else 'ies'} for {backend} (shipped" + (
        f" + {user})" if user.is_file() else ")")


def model_types() -> str:
    """How many model types are supported / listed unsupported, and the installed mlx-lm's MoE types that are
    neither (a newer mlx-lm than the adapters know)."""
    from ..adapters import REGISTRY, UNSUPPORTED
    from ..adapters.coverage import unknown_moe_types

    text = f"{len(REGISTRY)} supported, {len(UNSUPPORTED)} unsupported (see docs/guide/architectures.md)"
    unknown = unknown_moe_types()
    if unknown:
        text += f"; MoE types of this mlx-lm that mlx-fun does not know yet: {', '.join(unknown)}"
    return text
