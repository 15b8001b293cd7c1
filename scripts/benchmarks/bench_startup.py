#!/usr/bin/env python3
"""Benchmark the fixed start of mlx-fun commands: lean imports (today) against eager ones (before), same run.

    python -m scripts.benchmarks.bench_startup [--model DIR] [--build-gpu-model DIR] [--repeats 3] [--lean-only]

Every timing is the wall time of a fresh ``python -m mlx_fun <command>`` (the console entry: BLAS re-exec, CLI,
job) as seen from here. ``eager`` runs with ``MLX_FUN_EAGER_IMPORTS=1``: imports as mlx-lm makes them
(transformers at once, and PyTorch with it wherever PyTorch is installed), i.e. mlx-fun before issue 32;
``lean`` is the default (:mod:`mlx_fun.runtime.lean_imports`). The two alternate, best of ``--repeats``.

- commands that tokenize, on ``--model`` (default: the bundled data/tiny-moe): ``collect`` (1 sample of 8 tokens),
  ``eval`` (1 sample of 8 tokens), ``smoke-test`` (1 token);
- commands that never tokenize: ``prune`` (``--n-prune 8`` from a random saliency file of the right shape) on
  ``--model`` or on the 4-bit Qwen3-30B-A3B-shaped 12-layer model ``--build-gpu-model DIR`` builds there (~4 GB;
  scripts/benchmarks/bench_gpu.py's shape, saved with the bundled tokenizer); ``quantize`` on ``--model``;
  ``amplify`` on a tiny random deepseek_v3 (a router bias to boost) with a two-expert domain map;
  ``stats-diff`` / ``stats-merge`` / ``stats-purge`` on two random saliency files of ``--model``'s shape;
  ``tune-dispatch`` of one tiny synthetic layer (``--shape 64,32,8,2 --quant float32 --max-m 1``).
  Each run, and each ``cp -r`` of a model, starts from removed outputs with dirty pages flushed (``os.sync``), the
  model files in the page cache, and compiled modules cached (``PYTHONDONTWRITEBYTECODE`` is unset for the runs:
  round 1 writes the ``__pycache__`` a user's install has).

Last lines: ``torch_installed=<bool>``, ``<command>_eager_s=...``, ``<command>_lean_s=...``, ``cp_s=...`` (the
prune model's copy), ``cp_model_s=...`` (``--model``'s), ``prune_vs_cp=<lean prune / cp>``, then
``<command>_fixed_s=`` (lean wall minus the ``cp -r`` of the model it reads: the fixed start) with issue 44's goal
on a GPU host (:data:`GOALS`: 1.0 s for a command that never tokenizes, 2.5 s for one that does).
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
from scripts.lib.paths import BUNDLED, CALIBRATION
from scripts.lib.procs import root_env


def wall(cmd: list[str], *, eager: bool = False, check: bool = True) -> float:
    env = root_env()
    env.pop("MLX_FUN_EAGER_IMPORTS", None)
    # Python caches compiled modules (__pycache__) as on a user's machine, where pip compiles at install and an
    # editable install writes them on first run; the lent GPU machines set PYTHONDONTWRITEBYTECODE=1, which made
    # every run there compile mlx-fun, mlx-lm and click from source again (0.37 s of quantize's 1.27 s)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
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


#: Python run in a child (argv: model directory, domain map to write, tokenizer directory): a tiny random
#: deepseek_v3 (its correction bias is what amplify boosts) and a domain map naming two experts of its first MoE layer
DOMAIN_MODEL = """
import json, sys
from pathlib import Path
from mlx_fun.testing.tiny import make_tiny_model
out = make_tiny_model("deepseek_v3", sys.argv[1], vocab_size=2048, tokenizer_dir=sys.argv[3])
config = json.loads((out / "config.json").read_text())
moe = [i for i in range(config["num_hidden_layers"]) if i >= config.get("first_k_dense_replace", 0)]
composite = [[2.0, 2.0] + [0.0] * (config["n_routed_experts"] - 2) for _ in moe]
Path(sys.argv[2]).write_text(json.dumps({"domain_name": "bench", "scores": {"composite": composite},
                                         "domain_experts": {str(moe[0]): [0, 1]}}))
"""
#: issue 44's goal for the fixed start on a GPU host, seconds: commands that never tokenize, and the others
GOALS = {"tokenizer-free": 1.0, "tokenizing": 2.5}
TOKENIZING = ("collect", "eval", "smoke-test")


def domain_model(out: Path, domain: Path) -> Path:
    proc = subprocess.run([sys.executable, "-c", DOMAIN_MODEL, str(out), str(domain), str(BUNDLED)], env=root_env(),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"building the tiny deepseek_v3 failed:\n{proc.stderr[-2000:]}")
    return out


def copy_seconds(model: Path, tmp: Path) -> float:
    shutil.rmtree(tmp / "copy", ignore_errors=True)
    os.sync()
    return wall(["cp", "-r", str(model), str(tmp / "copy")])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model(p)
    p.add_argument("--build-gpu-model", default=None, metavar="DIR")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lean-only", action="store_true",
                   help="skip the eager runs (with PyTorch installed each takes ~20 s): the fixed starts alone")
    args = p.parse_args()
    torch = importlib.util.find_spec("torch") is not None
    model = Path(args.model)
    big = build_gpu_model(Path(args.build_gpu_model)) if args.build_gpu_model else model
    tmp = Path(tempfile.mkdtemp())
    out = tmp / "out"  # every command's outputs, removed before each run
    data = CALIBRATION
    sal1, sal2 = random_saliency(model, tmp / "s1.npz", seed=1), random_saliency(model, tmp / "s2.npz", seed=2)
    dsv3 = domain_model(tmp / "dsv3", tmp / "domain.json")
    cli = [sys.executable, "-m", "mlx_fun"]
    commands = {
        "collect": ["--model", model, "--dataset", data, "--max-samples", "1", "--max-tokens", "8",
                    "--output", out / "s.npz"],
        "eval": ["--model", model, "--dataset", data, "--max-samples", "1", "--max-tokens", "8"],
        "smoke-test": ["--model", model, "--prompt", "def f(x):", "--max-tokens", "1"],
        "prune": ["--model", big, "--saliency", random_saliency(big, tmp / "r.npz"), "--n-prune", "8",
                  "--output", out / "pruned"],
        "quantize": ["--model", model, "--output", out / "q4"],
        "amplify": ["--model", dsv3, "--domain-map", tmp / "domain.json", "--output", out / "amplified"],
        "stats-diff": ["--file1", sal1, "--file2", sal2],
        "stats-merge": ["--files", sal1, "--files", sal2, "--output", out / "merged.npz"],
        "stats-purge": ["--input", sal1, "--output", out / "purged.npz", "--min-freq", "100"],
        "tune-dispatch": ["--shape", "64,32,8,2", "--quant", "float32", "--max-m", "1", "--output", out / "t.json"],
    }
    reads = {"prune": big, "quantize": model, "amplify": dsv3, **{name: model for name in TOKENIZING}}
    best: dict[str, float] = {}
    try:
        for r in range(args.repeats):
            for name, rest in commands.items():
                for eager in (False,) if args.lean_only else ((False, True) if r % 2 else (True, False)):
                    key = f"{name}_{'eager' if eager else 'lean'}_s"
                    shutil.rmtree(out, ignore_errors=True)  # as for cp: a clean destination,
                    out.mkdir()
                    os.sync()  # and no dirty pages of the run before it to write back
                    best[key] = min(best.get(key, float("inf")), wall(cli + [name, *map(str, rest)], eager=eager))
            for key, path in (("cp_s", big), ("cp_model_s", model), ("cp_dsv3_s", dsv3)):
                best[key] = min(best.get(key, float("inf")), copy_seconds(path, tmp))
            print(f"round {r + 1}: " + json.dumps({k: round(v, 2) for k, v in best.items()}), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    copies = {big: best["cp_s"], model: best["cp_model_s"], dsv3: best["cp_dsv3_s"]}
    print(f"model={big}")
    print(f"torch_installed={torch}")
    for key, value in best.items():
        print(f"{key}={value:.2f}")
    print(f"prune_vs_cp={best['prune_lean_s'] / best['cp_s']:.2f}")
    for name in commands:
        fixed = best[f"{name}_lean_s"] - (copies[reads[name]] if name in reads else 0.0)
        goal = GOALS["tokenizing" if name in TOKENIZING else "tokenizer-free"]
        print(f"{name}_fixed_s={fixed:.2f}  (goal on a GPU host: <= {goal} s{'' if fixed <= goal else ': over'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
