#!/usr/bin/env python3
"""Benchmark one sampling step: mlx-lm's categorical sampler against mlx-fun's Gumbel-max sampler.

    python -m scripts.benchmarks.bench_sampling [--vocab 151936] [--iters 400] [--warmup 50] [--dtype float32]

Both samplers get the same ``(1, vocab)`` log-probabilities (what ``mlx_lm.generate.generate_step`` hands a
sampler: batch 1), at temperature 1, and every token is forced with ``mx.eval`` and timed on its own. The
timings are interleaved (the candidates take turns in shuffled rounds) so that drift in clock speed hits all of
them alike; each figure is the median over ``--iters`` tokens after ``--warmup`` untimed ones.

- ``mlx_lm``: ``mlx_lm.sample_utils.make_sampler(temp=1.0)`` (the compiled ``mx.random.categorical``);
- ``ours``: ``mlx_fun.model.sampling.GumbelSampler(temperature=1.0, seed=0)`` as used by ``smoke-test``: a fresh key
  ``mx.random.key(seed + step)`` per token, compiled only on a GPU (the default policy);
- for information: ours unseeded (MLX's global key), and ours forced compiled / uncompiled.

The last line is ``sampler_speedup=<mlx_lm median / ours median>`` (> 1 means ours is faster).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--iters", type=int, default=400, help="Timed tokens per sampler.")
    ap.add_argument("--warmup", type=int, default=50, help="Untimed tokens per sampler first.")
    ap.add_argument("--round", type=int, default=10, help="Consecutive tokens per sampler in each shuffled round.")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()

    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler as mlx_lm_make_sampler

    from mlx_fun.model.sampling import GumbelSampler, default_compiled

    dtype = getattr(mx, args.dtype)
    logits = mx.random.normal((1, args.vocab), key=mx.random.key(0)) * 3.0
    logprobs = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(dtype)
    mx.eval(logprobs)

    candidates = {
        "mlx_lm": mlx_lm_make_sampler(temp=1.0),
        "ours": GumbelSampler(temperature=1.0, seed=0),
        "ours_unseeded": GumbelSampler(temperature=1.0),
        "ours_compiled": GumbelSampler(temperature=1.0, seed=0, compiled=True),
        "ours_uncompiled": GumbelSampler(temperature=1.0, seed=0, compiled=False),
    }
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for fn in candidates.values():
        for _ in range(args.warmup):
            mx.eval(fn(logprobs))

    rng = random.Random(0)
    rounds = -(-args.iters // args.round)
    for _ in range(rounds):
        order = list(candidates)
        rng.shuffle(order)
        for name in order:
            fn = candidates[name]
            for _ in range(args.round):
                t0 = time.perf_counter()
                mx.eval(fn(logprobs))
                times[name].append(time.perf_counter() - t0)

    med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    print(f"device: {mx.default_device()}  mlx {mx.__version__}  vocab {args.vocab}  dtype {args.dtype}  "
          f"batch 1  {rounds * args.round} timed tokens each (median)  ours compiled by default: {default_compiled()}")
    for name, ms in med.items():
        q1, q3 = (statistics.quantiles(times[name], n=4)[i] * 1e3 for i in (0, 2))
        print(f"  {name:16s} {ms:7.3f} ms/token   (IQR {q1:.3f}–{q3:.3f})   x{med['mlx_lm'] / ms:.2f} vs mlx_lm")
    print(f"sampler_speedup={med['mlx_lm'] / med['ours']:.3f}")


if __name__ == "__main__":
    main()
