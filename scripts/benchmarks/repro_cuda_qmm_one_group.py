#!/usr/bin/env python3
"""Minimal MLX repro: on CUDA, a quantized matmul whose input width equals the group size is wrong for M > 1.

    python -m scripts.benchmarks.repro_cuda_qmm_one_group

``nn.QuantizedLinear`` (affine) with ``input_dims == group_size`` — one quantization group per row — returns
wrong values (relative error ~1, sometimes nan) on MLX 0.32.4's CUDA backend as soon as more than one row is
multiplied; one row, or two groups per row, are right. The CPU backend is right everywhere. Real MoE routers
(input = hidden size ≥ 1,024) never have a single group; the tiny test models (hidden 64, routers kept at 8-bit
group 64 by mlx-lm's ``quantize_model``) do, which is why the per-family 4-bit tests fail on CUDA and the float
ones pass. Prints one line per case: ``K=<in> N=<out> bits gs M=<rows> rel_err=<max |q(x) - x·deq(W)ᵀ| / max|·|>``.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def main() -> int:
    mx.random.seed(0)
    print("device:", mx.default_device())
    for K, N, bits, gs in [(64, 8, 8, 64), (64, 8, 4, 64), (64, 8, 4, 32), (128, 8, 8, 64)]:
        q = nn.QuantizedLinear.from_linear(nn.Linear(K, N, bias=False), group_size=gs, bits=bits)
        w = mx.dequantize(q.weight, q.scales, q.biases, group_size=gs, bits=bits)
        for M in (1, 5):
            x = mx.random.normal((M, K))
            ref = x @ w.T
            err = float(mx.abs(q(x) - ref).max() / mx.abs(ref).max())
            print(f"K={K} N={N} bits={bits} gs={gs} M={M} rel_err={err:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
