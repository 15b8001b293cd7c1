#!/usr/bin/env python3
"""Quantized models with half-precision scales on the CPU: MLX's own quantized matmuls against mlx-fun's float32
path (:func:`mlx_fun.dispatch.experts.half_on_cpu`, :mod:`mlx_fun.dispatch.dense`), measured in one run.

    python -m scripts.benchmarks.bench_half_cpu [--model data/tiny-moe] [--bits 4] [--group-size 32] [--rounds 20]

``mlx_lm.convert`` keeps a checkpoint's dtype for the scales and biases it writes, so nearly every published
quantized model (converted from bfloat16) has bfloat16 scales. Part 1 times single ops (a 256 → 768 linear, 64
experts of 256 → 32 with top-8) at M = 1 and 64 rows: ``mx.quantized_matmul`` / ``mx.gather_qmm`` in the scales'
dtype against the same call with the input, scales and biases cast to float32 (the cast included). Part 2 casts
``--model`` (a float model) to bfloat16 and float16, quantizes each with ``mlx-fun quantize`` (scales in that dtype),
and times a forward of the whole model on 1 token (a decode step's shape) and on 128 (a prefill) with no dispatch
(what ``mlx_lm.generate`` runs) against ``dispatch.apply(model, "auto")`` (what every mlx-fun command runs). Every
line ends with ``ratio=<mlx time / mlx-fun time>``; beside it, the largest logit difference on 32 tokens against the
same model with float32 scales (and float32 everything else).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from mlx_fun.runtime.blas import maybe_reexec

from scripts.lib.options import add_model

maybe_reexec()  # the fast BLAS, as the mlx-fun launcher has it

import mlx.core as mx  # noqa: E402


def timed(f, rounds: int) -> float:
    mx.eval(f())
    t = time.perf_counter()
    for _ in range(rounds):
        mx.eval(f())
    return (time.perf_counter() - t) / rounds


def ops(rounds: int, bits: int, gs: int) -> None:
    f32 = mx.float32
    for dtype in (mx.bfloat16, mx.float16):
        for m in (1, 64):
            n = rounds * (10 if m == 1 else 1)  # a 1-row op takes about 0.1 ms: more rounds for a stable time
            mx.random.seed(0)
            wq, s, b = mx.quantize(mx.random.normal((768, 256)).astype(dtype), group_size=gs, bits=bits)
            x = mx.random.normal((m, 256)).astype(dtype)
            kw = dict(transpose=True, group_size=gs, bits=bits)
            half = timed(lambda: mx.quantized_matmul(x, wq, s, b, **kw), n)
            ours = timed(lambda: mx.quantized_matmul(x.astype(f32), wq, s.astype(f32), b.astype(f32), **kw)
                         .astype(dtype), n)
            print(f"op quantized_matmul {dtype} M={m}: {half * 1e6:9.0f} us  float32 {ours * 1e6:8.0f} us  "
                  f"ratio={half / ours:.1f}", flush=True)
            eq, es, eb = mx.quantize(mx.random.normal((64, 32, 256)).astype(dtype), group_size=gs, bits=bits)
            idx = mx.random.randint(0, 64, (m, 1, 8)).astype(mx.uint32)
            xe = x[:, None, None, :]
            half = timed(lambda: mx.gather_qmm(xe, eq, es, eb, rhs_indices=idx, **kw), n)
            ours = timed(lambda: mx.gather_qmm(xe.astype(f32), eq, es.astype(f32), eb.astype(f32), rhs_indices=idx,
                                               **kw).astype(dtype), n)
            print(f"op gather_qmm       {dtype} M={m}: {half * 1e6:9.0f} us  float32 {ours * 1e6:8.0f} us  "
                  f"ratio={half / ours:.1f}", flush=True)


def models(args) -> None:
    import shutil
    import subprocess

    from mlx.utils import tree_map
    from mlx_lm import load

    from mlx_fun.dispatch import experts as dispatch

    tokens = mx.array([[(i * 37) % 1000 + 5 for i in range(128)]])
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("bfloat16", "float16"):
            half_dir = Path(tmp) / dtype
            shutil.copytree(args.model, half_dir)
            for f in half_dir.glob("*.safetensors"):
                w = mx.load(str(f))
                mx.save_safetensors(str(f), {k: v.astype(getattr(mx, dtype)) for k, v in w.items()},
                                    {"format": "mlx"})
            subprocess.run([sys.executable, "-m", "mlx_fun", "quantize", "--model", str(half_dir), "--output",
                            str(half_dir) + "-q", "--expert-bits", str(args.bits), "--dense-bits", str(args.bits),
                            "--expert-group-size", str(args.group_size), "--dense-group-size", str(args.group_size)],
                           check=True, capture_output=True)
            model, _ = load(str(half_dir) + "-q")
            ref, _ = load(str(half_dir) + "-q")
            ref.update(tree_map(lambda w: w if w.dtype == mx.uint32 else w.astype(mx.float32), ref.parameters()))
            want = ref(tokens[:, :32]).astype(mx.float32)
            for name, n in (("decode step", 1), ("prefill 128", 128)):
                rounds = args.rounds * (5 if n == 1 else 1)
                mlx_t = timed(lambda: model(tokens[:, :n]), rounds)
                dispatch.apply(model, "auto")
                ours_t = timed(lambda: model(tokens[:, :n]), rounds)
                diff = float(mx.abs(model(tokens[:, :32]).astype(mx.float32) - want).max())
                dispatch.remove(model)
                print(f"model {dtype}-scale {args.bits}-bit g{args.group_size} {name}: mlx {mlx_t * 1e3:8.2f} ms  "
                      f"mlx-fun {ours_t * 1e3:7.2f} ms  max|diff| vs float32 scales {diff:.3f}  "
                      f"ratio={mlx_t / ours_t:.1f}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model(p, help="a float model to cast and quantize")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    print(f"MLX {mx.__version__} on {mx.default_device()}", flush=True)
    ops(args.rounds, args.bits, args.group_size)
    models(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
