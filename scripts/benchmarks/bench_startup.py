#!/usr/bin/env python3
"""Benchmark the fixed start of mlx-fun commands: lean imports (today) against eager ones (before), same run.

    python -m scripts.benchmarks.bench_startup [--model DIR] [--build-gpu-model DIR] [--repeats 3]

Every timing is the wall time of a fresh ``python -m mlx_fun <command>`` (the console entry: BLAS re-exec, CLI,
job) as seen from here. ``eager`` runs with ``MLX_FUN_EAGER_IMPORTS=1``: imports as mlx-lm makes them
(transformers at once, and PyTorch with it wherever PyTorch is installed), i.e. mlx-fun before issue 32;
``lean`` is the default (:mod:`mlx_fun.runtime.lean_imports`). The two alternate, best of ``--repeats``.

- ``collect`` (1 sample of 8 tokens), ``eval`` (1 sample of 8 tokens), ``smoke-test`` (1 token) on ``--model``
  (default: the bundled data/tiny-moe): the fixed start of a command that tokenizes;
- ``prune`` (``--n-prune 8`` from a random saliency file of the right shape) against ``cp -r`` of the same
  directory, on ``--model`` or on the 4-bit Qwen3-30B-A3B-shaped 12-layer model ``--build-gpu-model DIR`` builds
  there (~4 GB; scripts/benchmarks/bench_gpu.py's shape, saved with the bundled tokenizer). Each run, the copy's and
  prune's alike, starts from a removed destination with dirty pages flushed (``os.sync``), the model files in the page cache.

Last lines: ``torch_installed=<bool>``, ``<command>_eager_s=...``, ``<command>_lean_s=...``, ``cp_s=...``,
``prune_vs_cp=<lean prune / cp>``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.lib.models import gpu_shape, random_saliency, save_with_bundled_tokenizer
from scripts.lib.options import add_model
from scripts.lib.paths import CALIBRATION
from scripts.lib.procs import root_env


def wall(cmd: list[str], *, eager: bool = False, check: bool = True) -> float:
    env = root_env()
    env.pop("MLX_FUN_EAGER_IMPORTS", None)
    if eager:
        env["MLX_FUN_EAGER_IMPORTS"] = "1"
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if check and proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return seconds


def build_gpu_model(out: Path) -> Path:
    """The 12-layer 4-bit Qwen3-30B-A3B shape of scripts/benchmarks/bench_gpu.py, saved with the bundled tokenizer
    (kept: a directory that holds a config.json is used as it is)."""
    if (out / "config.json").is_file():
        return out
    model, config, _ = gpu_shape(layers=12, vocab=151936)
    return save_with_bundled_tokenizer(model, config, out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model(p)
    p.add_argument("--build-gpu-model", default=None, metavar="DIR")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch = importlib.util.find_spec("torch") is not None
    model = Path(args.model)
    big = build_gpu_model(Path(args.build_gpu_model)) if args.build_gpu_model else model
    tmp = Path(tempfile.mkdtemp())
    data = CALIBRATION
    cli = [sys.executable, "-m", "mlx_fun"]
    commands = {
        "collect": cli + ["collect", "--model", str(model), "--dataset", str(data), "--max-samples", "1",
                          "--max-tokens", "8", "--output", str(tmp / "s.npz")],
        "eval": cli + ["eval", "--model", str(model), "--dataset", str(data), "--max-samples", "1",
                       "--max-tokens", "8"],
        "smoke-test": cli + ["smoke-test", "--model", str(model), "--prompt", "def f(x):", "--max-tokens", "1"],
        "prune": cli + ["prune", "--model", str(big), "--saliency", str(random_saliency(big, tmp / "r.npz")),
                        "--n-prune", "8", "--output", str(tmp / "pruned")],
    }
    best: dict[str, float] = {}
    try:
        for r in range(args.repeats):
            for name, cmd in commands.items():
                for eager in ((False, True) if r % 2 else (True, False)):
                    key = f"{name}_{'eager' if eager else 'lean'}_s"
                    shutil.rmtree(tmp / "pruned", ignore_errors=True)  # as for cp: a clean destination,
                    os.sync()  # and no dirty pages of the run before it to write back
                    best[key] = min(best.get(key, float("inf")), wall(cmd, eager=eager))
            shutil.rmtree(tmp / "copy", ignore_errors=True)
            os.sync()
            best["cp_s"] = min(best.get("cp_s", float("inf")), wall(["cp", "-r", str(big), str(tmp / "copy")]))
            print(f"round {r + 1}: " + json.dumps({k: round(v, 2) for k, v in best.items()}), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"model={big}")
    print(f"torch_installed={torch}")
    for key, value in best.items():
        print(f"{key}={value:.2f}")
    print(f"prune_vs_cp={best['prune_lean_s'] / best['cp_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
