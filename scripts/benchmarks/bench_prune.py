#!/usr/bin/env python3
"""Benchmark `prune`: wall time and peak memory of `mlx-fun prune` against a plain copy of the model directory.

    python -m scripts.benchmarks.bench_prune [--layers 4] [--repeats 2] [--n-prune 16 32] [--workdir DIR] [--keep]
    python -m scripts.benchmarks.bench_prune --streaming        # a float32 model of 2.4 GiB: the streaming figures

Model: a random 4-bit qwen3_moe saved as an mlx-lm directory (hidden 1024, 64 experts, top 8, expert width
512, vocab 4096; group size 32 with float32 scales/biases as the tiny builder makes them, ≈ 75 MiB per layer,
4 layers ≈ 300 MiB on disk), built once and cached in ``--workdir`` (default: a temp dir,
removed at the end unless ``--keep``). The saliency file is random REAP statistics of the right shape (no
collect run: :func:`scripts.lib.models.random_saliency`). Every measurement reads a warm page cache (all model
files are read once first) and starts from a clean destination, with dirty pages flushed (``os.sync``) beforehand;
each is repeated ``--repeats`` times and the best is kept:

- ``copy``:     ``shutil.copytree`` of the model directory, in this process (the I/O floor);
- ``startup``:  a child Python that only imports ``mlx_fun.cli``, ``mlx.core`` and ``mlx_lm`` (fixed cost of
  any command, included in the prune times);
- ``prune N``:  ``mlx-fun prune --model M --saliency S --n-prune N --output OUT --force`` in a fresh child
  Python (``mlx_fun.cli.main`` with ``standalone_mode=False``), wall time as seen from here, peak RSS as the
  child's own ``ru_maxrss`` at exit. ``net s`` subtracts the ``startup`` time.

The last lines are ``prune_peak_rss_mib=<peak RSS of prune --n-prune 16>`` and
``prune_vs_copy=<prune --n-prune 16 wall time / copy wall time>``, ``prune_vs_copy_net`` (the same without the
``startup`` time, which a model this small cannot amortize); with ``--streaming`` (model: the same shape in
float32 with 6 layers, ≈ 2.4 GiB, each stacked expert projection 128 MiB) also
``peak_rss_ratio=<peak RSS of prune --n-prune 16 / (largest tensor + 300 MB)>``: prune streams tensor by tensor
(mlx_fun.output.streaming), so its memory should not grow with the model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.lib.models import random_saliency
from scripts.lib.procs import root_env

MARK = "@@bench_prune "

MODEL_KW = dict(
    bits=4,
    hidden_size=1024,
    intermediate_size=2048,
    moe_intermediate_size=512,
    num_experts=64,
    num_experts_per_tok=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=4096,
)

BUILD = """
import json, sys
from mlx_fun.testing.tiny import make_tiny_model
make_tiny_model("qwen3_moe", sys.argv[1], **json.loads(sys.argv[2]))
"""

# Runs the CLI (or only the imports) and reports its own wall time and peak RSS (KiB on Linux, bytes on macOS).
CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
rc = 0
if sys.argv[1:]:
    from mlx_fun.cli import main
    try:
        main(sys.argv[1:], prog_name="mlx-fun", standalone_mode=False)
    except SystemExit as e:
        rc = e.code or 0
else:
    import mlx.core, mlx_lm, mlx_fun.cli  # noqa: F401
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rss_kib = rss / 1024 if sys.platform == "darwin" else rss
print("%s" + json.dumps({"rc": rc, "elapsed_s": time.perf_counter() - t0, "maxrss_kib": rss_kib}))
""" % MARK


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def warm_read(path: Path) -> None:
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass


def clean(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    for stale in path.parent.glob(f".{path.name}.*"):  # leftovers of an interrupted atomic write
        shutil.rmtree(stale, ignore_errors=True)
    os.sync()


def python_child(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], env=root_env(), capture_output=True, text=True)


def run_child(*cli_args: str) -> dict:
    t = time.perf_counter()
    proc = python_child(CHILD, *cli_args)
    wall = time.perf_counter() - t
    marks = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or not marks or json.loads(marks[-1][len(MARK):])["rc"] != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"child failed: mlx-fun {' '.join(cli_args)}")
    info = json.loads(marks[-1][len(MARK):])
    info["wall_s"] = wall
    return info


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers, all MoE (4-bit: ≈ 75 MiB each, default 4; --streaming: ≈ 400 MiB, default 6)")
    p.add_argument("--streaming", action="store_true", help="a float32 model of ≥ 2 GB; print peak_rss_ratio")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--n-prune", type=int, nargs="+", default=[16, 32], help="first one feeds the summary lines")
    p.add_argument("--workdir", default=None, help="cache for the model and outputs (default: temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp work dir")
    args = p.parse_args()

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_prune."))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return bench(args, work)
    finally:
        if args.workdir is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        elif args.workdir is None:
            print(f"(kept {work})", file=sys.stderr)


def bench(args, work: Path) -> int:
    args.layers = args.layers or (6 if args.streaming else 4)
    kw = dict(MODEL_KW, num_hidden_layers=args.layers, **({"bits": None} if args.streaming else {}))
    model = work / f"qwen3_moe-L{args.layers}-{'f32' if args.streaming else '4bit'}"
    spec = model / "bench_spec.json"
    if not (spec.is_file() and json.loads(spec.read_text()) == kw):
        t = time.perf_counter()
        proc = python_child(BUILD, str(model), json.dumps(kw))
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout + proc.stderr)
            raise SystemExit("building the model failed")
        spec.write_text(json.dumps(kw))
        print(f"built {model} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        (work / "saliency.npz").unlink(missing_ok=True)
    saliency = work / "saliency.npz"
    if not saliency.is_file():
        random_saliency(model, saliency)

    size = dir_size(model)
    warm_read(model)
    copy_dst = work / "copy"
    outs = {n: work / f"pruned-{n}" for n in args.n_prune}
    best: dict[str, dict] = {}

    def keep_best(name: str, info: dict) -> None:
        if name not in best or info["wall_s"] < best[name]["wall_s"]:
            best[name] = info

    run_child()  # warm the interpreter's own files (mlx, mlx-lm) before anything is timed
    for _ in range(args.repeats):
        clean(copy_dst)
        t = time.perf_counter()
        shutil.copytree(model, copy_dst)
        keep_best("copy", {"wall_s": time.perf_counter() - t, "maxrss_kib": None})
        keep_best("startup", run_child())
        for n, out in outs.items():
            clean(out)
            keep_best(f"prune {n}", run_child("prune", "--model", str(model), "--saliency", str(saliency),
                                                "--n-prune", str(n), "--output", str(out), "--force"))

    mib = 1 << 20
    t_copy = best["copy"]["wall_s"]
    print(f"model: qwen3_moe {'float32' if args.streaming else '4-bit'}, {args.layers} layers × 64 experts (top 8), hidden 1024, expert width 512; "
          f"{size / mib:.1f} MiB on disk; best of {args.repeats}")
    print(f"{'run':<12} {'wall s':>8} {'in-proc s':>10} {'net s':>7} {'vs copy':>8} {'peak RSS MiB':>13} {'RSS/model':>10} "
          f"{'output MiB':>11}")
    for name, info in best.items():
        rss = info["maxrss_kib"]
        out = copy_dst if name == "copy" else outs.get(int(name.split()[1])) if name.startswith("prune") else None
        print(f"{name:<12} {info['wall_s']:>8.3f} "
              f"{info['elapsed_s'] if 'elapsed_s' in info else float('nan'):>10.3f} "
              f"{(info['wall_s'] - best['startup']['wall_s'] if name.startswith('prune') else float('nan')):>7.3f} "
              f"{info['wall_s'] / t_copy:>8.2f} "
              f"{(rss / 1024 if rss else float('nan')):>13.1f} "
              f"{(rss * 1024 / size if rss else float('nan')):>10.2f} "
              f"{(dir_size(out) / mib if out else float('nan')):>11.1f}")
    first = best[f"prune {args.n_prune[0]}"]
    print(f"prune_peak_rss_mib={first['maxrss_kib'] / 1024:.1f}")
    print(f"prune_vs_copy={first['wall_s'] / t_copy:.3f}")
    print(f"prune_vs_copy_net={(first['wall_s'] - best['startup']['wall_s']) / t_copy:.3f}")
    if args.streaming:
        from mlx_fun.output.streaming import source_tensors

        largest = max(t.nbytes for t in source_tensors(model).values())
        print(f"largest_tensor_mib={largest / mib:.1f}")
        print(f"peak_rss_ratio={first['maxrss_kib'] * 1024 / (largest + 300e6):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
