#!/usr/bin/env python3
"""Data-parallel `collect` under mlx.launch against one process, on the same samples.

    python -m scripts.benchmarks.bench_distributed [--model data/tiny-moe] [--ranks 2] [--samples 256]
                                                   [--tokens 512] [--backend ring] [--repeats 2]
                                                   [--build '{"num_hidden_layers": 12}']
    python -m scripts.benchmarks.bench_distributed --backend nccl --build '{...}'     # 2 GPUs of one host, NCCL

Model: ``--model`` or, with ``--build JSON``, a random qwen3_moe made in the temp dir by
``mlx_fun.testing.tiny.make_tiny_model`` with those keyword arguments, for runs where the bundled model is too small to
keep an accelerator busy. The README's two-GPU figure used (0.87 GiB on disk)::

    --samples 1024 --build '{"hidden_size":1024,"num_hidden_layers":12,"num_experts":64,"num_experts_per_tok":8,
      "moe_intermediate_size":512,"intermediate_size":2048,"num_attention_heads":16,"num_key_value_heads":4,
      "head_dim":64,"bits":4}'

With ``--backend nccl`` (one GPU a rank, ``CUDA_VISIBLE_DEVICES`` set by mlx.launch) the one process runs on one
GPU.

Dataset: ``--samples`` equal slices of Python's own standard library sources (``mlx_fun.testing.tiny``'s offline
corpus), written as JSONL in a temp dir. Each measurement is a fresh ``mlx-fun collect`` (``python -m mlx_fun``) and, for
N ranks, ``mlx.launch --backend BACKEND -n N -- python -m mlx_fun collect …`` (on this machine; the ring backend on
loopback). Prints wall times (process start to exit, best of ``--repeats``), the collect time each run reports
(``Wrote … in X s``: forwards + the cross-rank sum), and compares the two files (counts exact; sums to the
largest relative difference). Last lines: ``collect_speedup_wall=<one process / N ranks, wall>`` and
``collect_speedup=<one process / N ranks, reported collect time>``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from scripts.lib.options import add_build, add_model
from scripts.lib.procs import root_env
from scripts.lib.servers import free_port


def timed(cmd: list[str]) -> tuple[float, float, str]:
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=root_env(), capture_output=True, text=True)
    wall = time.perf_counter() - t
    m = re.search(r"Wrote .* tokens in ([0-9.]+) s", proc.stdout)
    if proc.returncode != 0 or m is None:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return wall, float(m.group(1)), proc.stdout.strip().splitlines()[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model(ap)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--backend", default="ring")
    ap.add_argument("--repeats", type=int, default=2)
    add_build(ap)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_distributed.") as tmp:  # removed however the run ends
        return measure(args, Path(tmp))


def measure(args: argparse.Namespace, tmp: Path) -> int:
    """The runs, their comparison and the report, with the model (``--build``), the dataset and every output in
    ``tmp``."""
    from mlx_fun.testing.tiny import _stdlib_corpus

    if args.build:
        from mlx_fun.testing.tiny import make_tiny_model

        args.model = str(make_tiny_model("qwen3_moe", tmp / "model", **json.loads(args.build)))
    text = "\n".join(_stdlib_corpus(max_chars=args.samples * args.tokens * 4))
    size = len(text) // args.samples  # one sample per slice, about --tokens tokens each
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps({"content": text[i * size:(i + 1) * size]}) + "\n"
                            for i in range(args.samples)))
    common = ["collect", "--model", args.model, "--dataset", str(data), "--max-samples", str(args.samples),
              "--max-tokens", str(args.tokens)]
    best = {}
    for r in range(args.repeats):
        for name, out in (("1 process", tmp / f"one{r}.npz"), (f"{args.ranks} ranks", tmp / f"many{r}.npz")):
            cmd = [sys.executable, "-m", "mlx_fun", *common, "--output", str(out)]
            if name != "1 process":
                cmd = [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()", "--backend",
                       args.backend, "-n", str(args.ranks), "--starting-port", str(free_port()),
                       "--nccl-port", str(free_port()), "--", *cmd]
            wall, reported, line = timed(cmd)
            if name not in best or wall < best[name][0]:
                best[name] = (wall, reported, line, out)
    a, b = np.load(best["1 process"][3]), np.load(best[f"{args.ranks} ranks"][3])
    counts = all(np.array_equal(a[k], b[k]) for k in ("freq", "reap_count", "total_tokens"))
    rel = max(float(np.max(np.abs(a[k] - b[k]) / np.maximum(np.abs(a[k]), 1e-300)))
              for k in ("weighted_freq_sum", "reap_sum", "ean_sum"))
    import mlx.core as mx

    gb = sum(f.stat().st_size for f in Path(args.model).glob("*.safetensors")) / 2**30
    print(f"model {Path(args.model).name} ({gb:.2f} GiB); {int(a['total_tokens']):,} tokens ({args.samples} samples "
          f"≤ {args.tokens} tokens); {os.cpu_count()} CPU cores; {mx.default_device()}; backend {args.backend}; "
          f"best of {args.repeats}")
    for name, (wall, reported, line, _) in best.items():
        print(f"{name:>10}: wall {wall:6.2f} s, collect {reported:6.2f} s  ({line})")
    print(f"same_file: counts {'equal' if counts else 'DIFFER'}, sums within {rel:.1e} relative (on CPUs, ranks on one "
          f"host share its cores, so their BLAS runs fewer threads and float32 forwards round differently; with "
          f"equal OPENBLAS_NUM_THREADS the test sees <= 1e-9)")
    one, many = best["1 process"], best[f"{args.ranks} ranks"]
    print(f"collect_speedup_wall={one[0] / many[0]:.2f}")
    print(f"collect_speedup={one[1] / many[1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
