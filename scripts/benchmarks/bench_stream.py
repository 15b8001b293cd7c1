"""Benchmark layer-streamed runs (issue 43): a model larger than the memory the process may use.

    sudo python -m scripts.benchmarks.bench_stream [--limit 2GiB] [--layers 9] [--experts 32] [--hidden 1536]
                                                   [--width 1024] [--samples 8] [--tokens 256] [--keep DIR]

Builds a float32 ``qwen3_moe`` with the bundled tokenizer (about 5.7 GB with the defaults: 9 decoder layers of
~0.6 GB), then runs ``mlx-fun collect`` on the bundled calibration text three times:

1. in memory, without a limit: the reference statistics, wall time and peak RSS;
2. in memory (``--no-stream-layers``), in a memory cgroup of ``--limit``: killed by the limit (shown, not assumed);
3. in the same cgroup with no flag: collect sees the limit and streams the layers by itself (its note is printed);
   completes; peak memory of the cgroup, wall time, and ``streamed_equal`` (counts bit-identical, sums within
   float rounding of run 1).

Then ``mlx-fun eval`` of the model against itself as ``--reference`` the same way (in memory unlimited; in the
cgroup, streamed by itself): ``eval_streamed_equal`` compares perplexity, KL and top-1 agreement.

Needs root for the cgroup (v1 ``/sys/fs/cgroup/memory``, or v2). Prints one ``key=value`` line per figure.

``--gpu-shape`` (the GPU row, on a machine with a GPU and room for the model):

    python -m scripts.benchmarks.bench_stream --gpu-shape --layers 48 --samples 16 --tokens 2048 --keep DIR

builds the 4-bit Qwen3-30B-A3B shape of ``scripts/benchmarks/bench_gpu.py`` (:func:`scripts.lib.models.gpu_shape`,
``--layers`` decoder layers, saved with the bundled tokenizer), writes ``--samples`` texts of at least ``--tokens``
tokens (the bundled calibration text in a seeded order, repeated), and runs collect in memory and with
``--stream-layers``, each ``--repeats`` times (no cgroup, no root): the best wall times, ``gpu_time_ratio``
(streamed / in memory; goal <= 1.3), each run's GPU and host peaks (collect's own line), ``gpu_streamed_equal``.
``--quick`` builds small shapes instead: a check of the script itself.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.lib.paths import BUNDLED, CALIBRATION
from scripts.lib.procs import root_env

_EXE = shutil.which("mlx-fun") or str(Path(sys.executable).with_name("mlx-fun"))
#: the command line of the CLI: its script, or ``python -m mlx_fun`` where none is installed (a lent GPU machine)
MLX_FUN = [_EXE] if Path(_EXE).is_file() else [sys.executable, "-m", "mlx_fun"]


class MemoryCgroup:
    """A memory cgroup of ``limit`` bytes (v1 or v2) that children join before they exec."""

    def __init__(self, limit: int):
        self.limit = limit
        v1 = Path("/sys/fs/cgroup/memory")
        if v1.is_dir():
            self.path, self.v2 = v1 / f"mlx-fun-bench-{os.getpid()}", False
        else:
            self.path, self.v2 = Path("/sys/fs/cgroup") / f"mlx-fun-bench-{os.getpid()}", True
        self.path.mkdir()
        if self.v2:
            (self.path / "memory.max").write_text(str(limit))
            (self.path / "memory.swap.max").write_text("0")
        else:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            swap = self.path / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(limit))

    def join(self) -> None:  # preexec_fn
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int:
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        return int((self.path / name).read_text())

    def reset(self) -> None:
        if not self.v2:
            (self.path / "memory.max_usage_in_bytes").write_text("0")

    def remove(self) -> None:
        self.path.rmdir()


def parse_bytes(text: str) -> int:
    from mlx_fun.core.sizes import parse_bytes as parse

    return parse(text)


def build(out: Path, args) -> Path:
    from mlx_fun.testing.tiny import make_tiny_model

    vocab = int(__import__("json").loads((BUNDLED / "config.json").read_text())["vocab_size"])
    return make_tiny_model("qwen3_moe", out, vocab_size=vocab, tokenizer_dir=BUNDLED, num_hidden_layers=args.layers,
                           num_experts=args.experts, hidden_size=args.hidden, moe_intermediate_size=args.width,
                           intermediate_size=args.width * 2, num_experts_per_tok=4, num_attention_heads=8,
                           num_key_value_heads=4, head_dim=args.hidden // 8)


def run(cmd: list[str], cgroup: MemoryCgroup | None):
    """``(returncode, seconds, peak bytes, stderr then stdout)`` of one child: the cgroup's peak inside it, else the largest
    resident set of the children so far (each measured run here is larger than the ones before it)."""
    if cgroup is not None:
        cgroup.reset()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=root_env(), capture_output=True, text=True,
                          preexec_fn=cgroup.join if cgroup is not None else None)
    seconds = time.perf_counter() - t0
    peak = cgroup.peak() if cgroup is not None else resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return proc.returncode, seconds, peak, proc.stderr + proc.stdout


def collect(model: Path, out: Path, args, *extra: str, cgroup: MemoryCgroup | None = None):
    """One ``mlx-fun collect`` child (:func:`run`)."""
    return run([*MLX_FUN, "collect", "--model", str(model), "--dataset", str(args.dataset), "--output", str(out),
                "--max-samples", str(args.samples), "--max-tokens", str(args.tokens), "--seed", "0", *extra], cgroup)


def evaluate(model: Path, out: Path, args, *extra: str, cgroup: MemoryCgroup | None = None):
    """One ``mlx-fun eval`` child (:func:`run`): the model against itself as ``--reference``."""
    return run([*MLX_FUN, "eval", "--model", str(model), "--reference", str(model), "--dataset", str(args.dataset),
                "--max-samples", str(args.samples), "--max-tokens", str(args.tokens), "--output", str(out), *extra],
               cgroup)


def eval_equal(a: Path, b: Path) -> bool:
    import json
    import math

    x, y = json.loads(a.read_text())["datasets"], json.loads(b.read_text())["datasets"]
    return x.keys() == y.keys() and all(
        x[d].get("tokens") == y[d].get("tokens") and all(math.isclose(x[d][k], y[d][k], rel_tol=1e-5, abs_tol=1e-7)
                                                for k in x[d] if isinstance(x[d][k], float))
        for d in x)


def equal(a: Path, b: Path) -> bool:
    import numpy as np

    from mlx_fun.observe.saliency import SaliencyAccumulator

    x, y = SaliencyAccumulator.load(a), SaliencyAccumulator.load(b)
    return bool(np.array_equal(x.freq, y.freq) and np.array_equal(x.reap_count, y.reap_count)
                and x.total_tokens == y.total_tokens
                and all(np.allclose(getattr(x, k), getattr(y, k), rtol=1e-5, atol=1e-6)
                        for k in ("weighted_freq_sum", "reap_sum", "ean_sum", "max_activation_norm")))


def long_texts(out: Path, *, samples: int, tokens: int) -> Path:
    """A JSONL of ``samples`` texts, each the bundled calibration texts in a seeded order, repeated until it has at
    least ``tokens`` tokens (4 characters a token, a safe over-estimate for the bundled tokenizer)."""
    import json
    import random

    texts = [row.get("content") or row.get("prompt") or row.get("text") or json.dumps(row)
             for row in map(json.loads, CALIBRATION.read_text().splitlines())]
    with open(out, "w") as f:
        for i in range(samples):
            rng, parts = random.Random(i), []
            while sum(len(p) for p in parts) < 4 * tokens:
                parts += rng.sample(texts, len(texts))
            f.write(json.dumps({"content": "\n\n".join(parts)}) + "\n")
    return out


def gpu_row(work: Path, args) -> None:
    """The GPU row (module docstring): collect in memory vs streamed on the Qwen3-30B-A3B shape."""
    import re

    model = args.keep or work / "model"
    if not (model / "config.json").exists():  # built in a child: a child's peak RSS starts at its parent's
        t0 = time.perf_counter()
        build = ("import sys; from pathlib import Path; from scripts.lib.models import gpu_shape, "
                 "save_with_bundled_tokenizer as save; m, c, _ = gpu_shape(layers=int(sys.argv[1]), vocab=151936, "
                 "quick=sys.argv[2] == '1'); save(m, c, Path(sys.argv[3]))")
        subprocess.run([sys.executable, "-c", build, str(args.layers), str(int(args.quick)), str(model)],
                       env=root_env(), check=True)
        print(f"built_seconds={time.perf_counter() - t0:.1f}", flush=True)
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    print(f"weights_bytes={weights} layers={args.layers}", flush=True)
    best = {}
    for rep in range(args.repeats):
        for name, flag in (("inmem", "--no-stream-layers"), ("streamed", "--stream-layers")):
            rc, secs, _peak, err = collect(model, work / f"{name}.npz", args, flag, "--force")
            assert rc == 0, err[-3000:]
            line = next((x for x in err.splitlines() if x.startswith("Wrote ")), "")
            peaks = re.findall(r"peak memory ([\d.,]+ \w+)(?:; GPU peak ([\d.,]+ \w+))?", line)
            tokens = re.findall(r"\(([\d,]+) tokens", line)
            print(f"{name}_run{rep}_seconds={secs:.1f} tokens={tokens[0] if tokens else '?'} {name}_host_peak={peaks[0][0] if peaks else '?'} "
                  f"{name}_gpu_peak={peaks[0][1] if peaks else '?'}", flush=True)
            best[name] = min(best.get(name, secs), secs)
    print(f"gpu_inmem_seconds={best['inmem']:.1f} gpu_streamed_seconds={best['streamed']:.1f} "
          f"gpu_time_ratio={best['streamed'] / best['inmem']:.2f}")
    print(f"gpu_streamed_equal={str(equal(work / 'inmem.npz', work / 'streamed.npz')).lower()}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", default="2GiB", help="memory cgroup limit of runs 2 and 3 (default 2GiB)")
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--width", type=int, default=1024, help="expert width (moe_intermediate_size)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--keep", type=Path, default=None, help="build the model here (kept) instead of a temp dir")
    ap.add_argument("--gpu-shape", action="store_true", help="the GPU row: 4-bit Qwen3-30B-A3B shape, no cgroup")
    ap.add_argument("--repeats", type=int, default=1, help="--gpu-shape: runs of each, the best kept")
    ap.add_argument("--quick", action="store_true", help="--gpu-shape with small shapes: a check of the script")
    args = ap.parse_args()
    args.dataset = CALIBRATION
    if args.gpu_shape:
        work = Path(tempfile.mkdtemp(prefix="bench-stream-gpu-"))
        try:
            args.dataset = long_texts(work / "texts.jsonl", samples=args.samples, tokens=args.tokens)
            gpu_row(work, args)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    if os.geteuid() != 0:
        sys.exit("bench_stream needs root for its memory cgroup; run it with sudo.")
    limit = parse_bytes(args.limit)
    work = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    try:
        model = args.keep or work / "model"
        if not (model / "config.json").exists():
            build(model, args)
        weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        print(f"weights_bytes={weights} limit_bytes={limit} ratio={weights / limit:.2f}", flush=True)
        rc, s_mem, p_mem, err = collect(model, work / "inmem.npz", args, "--no-stream-layers")
        assert rc == 0, err
        print(f"inmem_seconds={s_mem:.1f} inmem_peak_rss={p_mem}", flush=True)
        cgroup = MemoryCgroup(limit)
        try:
            rc, s, p, err = collect(model, work / "limited.npz", args, "--no-stream-layers", cgroup=cgroup)
            killed = rc in (-9, 137) or rc < 0
            print(f"inmem_limited_returncode={rc} inmem_limited_killed={str(killed).lower()} "
                  f"inmem_limited_peak={p}", flush=True)
            rc, s_st, p_st, err = collect(model, work / "streamed.npz", args, cgroup=cgroup)
            assert rc == 0, err
            notes = [line for line in err.splitlines() if "stream" in line.lower()]
            print(f"streamed_seconds={s_st:.1f} streamed_peak={p_st} streamed_time_ratio={s_st / s_mem:.2f}")
            print(f"streamed_auto_note={notes[:1]}")
            print(f"streamed_equal={str(equal(work / 'inmem.npz', work / 'streamed.npz')).lower()}", flush=True)
            rc, e_mem, ep_mem, err = evaluate(model, work / "eval-inmem.json", args, "--no-stream-layers")
            assert rc == 0, err
            rc, e_st, ep_st, err = evaluate(model, work / "eval-streamed.json", args, cgroup=cgroup)
            assert rc == 0, err
            print(f"eval_inmem_seconds={e_mem:.1f} eval_inmem_peak_rss={ep_mem} eval_streamed_seconds={e_st:.1f} "
                  f"eval_streamed_peak={ep_st} eval_time_ratio={e_st / e_mem:.2f}")
            same = eval_equal(work / "eval-inmem.json", work / "eval-streamed.json")
            print(f"eval_streamed_equal={str(same).lower()}")
        finally:
            cgroup.remove()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
