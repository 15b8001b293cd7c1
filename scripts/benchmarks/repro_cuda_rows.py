#!/usr/bin/env python3
"""Minimal MLX repro of the CUDA launch failure at large grouped-matmul row counts (issue "One run path").

    python -m scripts.benchmarks.repro_cuda_rows [--dim 2048] [--width 768] [--experts 128]

Each probe runs in its own process (a failed CUDA launch can leave the context unusable) and prints ``ok`` or
the first line of the error. Probes: ``mx.gather_qmm`` (4-bit affine) and ``mx.gather_mm`` with ``rows`` routed
(token, expert) rows laid out as mlx-lm's ``SwitchGLU`` lays them out — x (rows, 1, D), one expert index per
row, sorted or not — at 65,535 and 65,536 rows; then mlx-lm's ``SwitchGLU`` itself and mlx-fun's dispatched one
at 4 × 2,048 and 16 × 2,048 tokens × top-8. On the CPU every probe passes; on CUDA (mlx 0.32.4) the grouped
matrix-vector kernels put the rows on a grid dimension capped at 65,535.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from scripts.lib.procs import root_env

#: one probe, run by a child Python whose PYTHONPATH starts with the checkout (:func:`scripts.lib.procs.root_env`)
PROBE = r"""
import mlx.core as mx
kind, rows, sort, dtype = {kind!r}, {rows}, {sort}, mx.{dtype}
D, W, E, K = {dim}, {width}, {experts}, 8
mx.random.seed(0)
if kind in ("gather_qmm", "gather_mm"):
    idx = mx.random.randint(0, E, (rows,)).astype(mx.uint32)
    if sort:
        idx = mx.sort(idx)
    x = (mx.random.normal((rows, 1, D)) * 0.1).astype(dtype)
    w = (mx.random.normal((E, W, D)) * 0.02).astype(dtype)
    if kind == "gather_qmm":
        q, s, b = mx.quantize(w, group_size=64, bits=4)
        y = mx.gather_qmm(x, q, s, b, rhs_indices=idx, transpose=True, group_size=64, bits=4, sorted_indices=sort)
    else:
        y = mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=sort)
else:
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchGLU
    tokens = rows // K
    glu = SwitchGLU(D, W, E)
    glu.update(__import__("mlx.utils").utils.tree_map(lambda a: (a * 0.02).astype(dtype), glu.parameters()))
    nn.quantize(glu, group_size=64, bits=4)
    if kind == "dispatched":
        from mlx_fun.dispatch import experts as dispatch
        dispatch.install(glu)
    x = (mx.random.normal((1, tokens, D)) * 0.1).astype(dtype)
    idx = mx.random.randint(0, E, (1, tokens, K)).astype(mx.uint32)
    y = glu(x, idx)
mx.eval(y)
assert bool(mx.isfinite(y.astype(mx.float32)).all()), "non-finite output"
print("ok", y.shape)
"""


def probe(args, kind: str, rows: int, sort: bool, dtype: str) -> str:
    code = PROBE.format(kind=kind, rows=rows, sort=sort, dtype=dtype, dim=args.dim,
                        width=args.width, experts=args.experts)
    try:
        r = subprocess.run([sys.executable, "-c", code], env=root_env(), capture_output=True, text=True,
                           timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return "timeout"
    if r.returncode == 0:
        return r.stdout.strip().splitlines()[-1]
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    return "FAIL " + (lines[-1][:160] if lines else f"exit {r.returncode}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--timeout", type=int, default=120)
    p.add_argument("--quick", action="store_true", help="small shapes (a CPU check of the script itself)")
    args = p.parse_args()
    import mlx.core as mx

    print(f"mlx {mx.__version__}, device {mx.default_device()}, D={args.dim} W={args.width} E={args.experts}")
    cases = []
    for kind in ("gather_qmm", "gather_mm"):
        for dtype in ("bfloat16", "float32"):
            for sort in (True, False):
                for rows in (65535, 65536):
                    cases.append((kind, rows, sort, dtype))
    for kind in ("switch_glu", "dispatched"):
        for dtype in ("bfloat16", "float32"):
            for tokens in (4 * 2048, 16 * 2048):
                cases.append((kind, tokens * 8, True, dtype))
    if args.quick:
        cases = [c for c in cases if c[1] <= 65536][:4] + [("dispatched", 4 * 2048 * 8, True, "float32")]
    for kind, rows, sort, dtype in cases:
        print(f"{kind:<11} rows={rows:>7} sorted={sort!s:<5} {dtype:<8} -> {probe(args, kind, rows, sort, dtype)}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
