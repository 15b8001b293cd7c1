"""Benchmark layer-streamed runs (issue 43): a model larger than the memory the process may use.

    sudo python -m scripts.benchmarks.bench_stream [--limit 2GiB] [--layers 9] [--experts 32] [--hidden 1536]
                                                   [--width 1024] [--samples 8] [--tokens 256] [--keep DIR]
    sudo python -m scripts.benchmarks.bench_stream --spill [--limit 448MiB] [--layers 2] [--experts 8]
                                                   [--hidden 256] [--width 256] [--samples 1024] [--tokens 512]

Builds a float32 ``qwen3_moe`` with the bundled tokenizer (about 5.7 GB with the defaults: 9 decoder layers of
~0.6 GB), then runs ``mlx-fun collect`` on the bundled calibration text three times:

1. in memory, without a limit: the reference statistics, wall time and peak RSS;
2. in memory (``--no-stream-layers``), in a memory cgroup of ``--limit``: killed by the limit (shown, not assumed);
3. in the same cgroup with no flag: collect sees the limit and streams the layers by itself (its note is printed);
   completes; peak memory of the cgroup, wall time, and ``streamed_equal`` (counts bit-identical, sums within
   float rounding of run 1).

Then ``mlx-fun eval`` of the model against itself as ``--reference`` the same way (in memory unlimited; in the
cgroup, streamed by itself): ``eval_streamed_equal`` compares perplexity, KL and top-1 agreement.

``--spill``: the hidden states rather than the weights are what does not fit. A small float32 ``qwen3_moe`` (the
defaults: 2 layers of ~7 MB) and many long samples (1,024 × 512 tokens of the bundled text, shuffled: 512 MiB of
float32 hidden states) go through ``collect --stream-layers`` twice: unlimited, the hidden states carried in
memory; and in a memory cgroup of ``--limit`` (default 448 MiB), where the automatic choice spills them to files
(its note is printed). Each run's own peak RSS (``wait4``), the cgroup's peak (page cache of the spill files
included), wall time, and ``spilled_identical`` (the two files' arrays bit for bit).

Needs root for the cgroup (v1 ``/sys/fs/cgroup/memory``, or v2). Prints one ``key=value`` line per figure.

``--gpu-shape`` (the GPU row, on a machine with a GPU and room for the model; no cgroup, no root):

    python -m scripts.benchmarks.bench_stream --gpu-shape --layers 48 --samples 16 --tokens 2048 --repeats 3

builds the 4-bit Qwen3-30B-A3B shape of ``scripts/benchmarks/bench_gpu.py`` (:func:`scripts.lib.models.gpu_shape`,
``--layers`` decoder layers, saved with the bundled tokenizer, in a child process of its own), writes ``--samples``
texts of at least ``--tokens`` tokens (:func:`corpus`), and runs collect in memory and with ``--stream-layers``,
alternating, ``--repeats`` times each: the best wall times, ``gpu_time_ratio`` (streamed / in memory; goal <= 1.3),
each run's host and GPU peaks (collect's own line), ``gpu_streamed_equal``. ``--quick``: small shapes, a check of
the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
#: the model and calibration shape of each mode (what an option not given takes)
SHAPES = {"stream": dict(limit="2GiB", layers=9, experts=32, hidden=1536, width=1024, samples=8, tokens=256),
          "spill": dict(limit="448MiB", layers=2, experts=8, hidden=256, width=256, samples=1024, tokens=512)}


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


def shape_args(ap, *, limit: str, experts: int, hidden: int = 1024, width: int = 1024, layers: int = 9) -> None:
    """The model-shape and limit options of the cgroup benchmarks (bench_stream_merge, bench_stream_abliterate)."""
    ap.add_argument("--limit", default=limit, help=f"memory cgroup limit of runs 2 and 3 (default {limit})")
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--experts", type=int, default=experts)
    ap.add_argument("--hidden", type=int, default=hidden)
    ap.add_argument("--width", type=int, default=width, help="expert width (moe_intermediate_size)")
    ap.add_argument("--keep", type=Path, default=None, help="build the model here (kept) instead of a temp dir")


def setup(args, name: str) -> tuple[Path, Path, int]:
    """``(work directory, model, limit in bytes)`` of a cgroup benchmark: root checked, the model built (or the one
    ``--keep`` holds), its size against the limit printed."""
    if os.geteuid() != 0:
        sys.exit(f"{name} needs root for its memory cgroup; run it with sudo.")
    limit = parse_bytes(args.limit)
    work = Path(tempfile.mkdtemp(prefix=f"{name.replace('_', '-')}-"))
    model = args.keep or work / "model"
    if not (model / "config.json").exists():
        build(model, args)
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    print(f"weights_bytes={weights} limit_bytes={limit} ratio={weights / limit:.2f}", flush=True)
    return work, model, limit


def limited_runs(go, limit: int):
    """Runs 1-3 (module docstring) of one command, ``go(name, *flags, cgroup=None)`` → :func:`run`'s tuple: in
    memory without a limit, in memory in a cgroup of ``limit`` (killed: shown, not assumed), and with no flag in
    the cgroup (it streams by itself). Prints their figures; returns runs 1 and 3."""
    first = go("inmem", "--no-stream-layers")
    assert first[0] == 0, first[3][-3000:]
    print(f"inmem_seconds={first[1]:.1f} inmem_peak_rss={first[4]}", flush=True)
    cgroup = MemoryCgroup(limit)
    try:
        rc, _s, peak, _out, _rss = go("limited", "--no-stream-layers", cgroup=cgroup)
        print(f"inmem_limited_returncode={rc} inmem_limited_killed={str(rc < 0 or rc == 137).lower()} "
              f"inmem_limited_peak={peak}", flush=True)
        third = go("streamed", cgroup=cgroup)
    finally:
        cgroup.remove()
    rc, seconds, peak, out, rss = third
    assert rc == 0, out[-3000:]
    notes = [line for line in out.splitlines() if "streaming the layers" in line]
    print(f"streamed_seconds={seconds:.1f} streamed_cgroup_peak={peak} streamed_peak_rss={rss} "
          f"streamed_time_ratio={seconds / first[1]:.2f}")
    print(f"streamed_auto_note={notes[:1]}", flush=True)
    return first, third


def run(cmd: list[str], cgroup: MemoryCgroup | None):
    """``(returncode, seconds, peak bytes, output, peak RSS bytes)`` of one child (``output``: its stderr and stdout
    together): the peak is the cgroup's inside it (page cache included), else the child's own peak resident set
    (``wait4``), which is also the last item."""
    if cgroup is not None:
        cgroup.reset()
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, env=root_env(), stdout=err, stderr=err,
                                preexec_fn=cgroup.join if cgroup is not None else None)
        _pid, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    seconds = time.perf_counter() - t0
    rss = usage.ru_maxrss * 1024
    return proc.returncode, seconds, cgroup.peak() if cgroup is not None else rss, stderr, rss


def collect(model: Path, out: Path, args, *extra: str, cgroup: MemoryCgroup | None = None,
            dataset: Path = CALIBRATION):
    """One ``mlx-fun collect`` child (:func:`run`)."""
    return run([*MLX_FUN, "collect", "--model", str(model), "--dataset", str(dataset), "--output", str(out),
                "--max-samples", str(args.samples), "--max-tokens", str(args.tokens), "--seed", "0", *extra], cgroup)


def evaluate(model: Path, out: Path, args, *extra: str, cgroup: MemoryCgroup | None = None):
    """One ``mlx-fun eval`` child (:func:`run`): the model against itself as ``--reference``."""
    return run([*MLX_FUN, "eval", "--model", str(model), "--reference", str(model), "--dataset", str(CALIBRATION),
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


def corpus(path: Path, samples: int, tokens: int = 0) -> Path:
    """``samples`` JSONL lines, each every text of the bundled calibration file twice over in its own shuffled order
    (seeded), repeated until it has at least ``tokens`` tokens (4 characters a token: an over-estimate for the
    bundled tokenizer): long samples, all distinct."""
    texts = []
    for line in CALIBRATION.read_text().splitlines():
        item = json.loads(line)
        texts += [m["content"] for m in item["messages"]] if "messages" in item else [
            item[k] for k in ("content", "prompt", "completion") if k in item]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(samples):
            rng, parts = random.Random(i), []
            while not parts or sum(len(p) for p in parts) < 4 * tokens:
                parts += rng.sample(texts * 2, 2 * len(texts))
            f.write(json.dumps({"content": " ".join(parts)}) + "\n")
    return path


def identical(a: Path, b: Path) -> bool:
    """The two .npz files hold the same arrays, bit for bit."""
    import numpy as np

    x, y = np.load(a), np.load(b)
    return sorted(x.files) == sorted(y.files) and all(np.array_equal(x[k], y[k]) for k in x.files)


def spill(model: Path, work: Path, args, limit: int) -> None:
    """The ``--spill`` runs (see the module docstring)."""
    data = corpus(work / "corpus.jsonl", args.samples)
    hidden = args.samples * args.tokens * args.hidden * 4
    print(f"hidden_states_bound_bytes={hidden} limit_bytes={limit}", flush=True)
    extra = ("--stream-layers", "--batch-size", "8")
    rc, s_mem, _p, err, rss_mem = collect(model, work / "carried.npz", args, *extra, dataset=data)
    assert rc == 0, err
    assert "spilling" not in err, err
    print(f"carried_seconds={s_mem:.1f} carried_peak_rss={rss_mem}", flush=True)
    cgroup = MemoryCgroup(limit)
    try:
        rc, s_sp, p_sp, err, rss_sp = collect(model, work / "spilled.npz", args, *extra, cgroup=cgroup, dataset=data)
    finally:
        cgroup.remove()
    assert rc == 0, f"returncode {rc}: {err}"
    notes = [line for line in err.splitlines() if "spilling" in line]
    print(f"spilled_seconds={s_sp:.1f} spilled_peak_rss={rss_sp} spilled_cgroup_peak={p_sp} "
          f"spill_time_ratio={s_sp / s_mem:.2f}")
    print(f"spilled_note={notes[:1]}")
    print(f"spilled_identical={str(identical(work / 'carried.npz', work / 'spilled.npz')).lower()}", flush=True)


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
    data = corpus(work / "texts.jsonl", args.samples, args.tokens)
    best = {}
    for rep in range(args.repeats):
        for name, flag in (("inmem", "--no-stream-layers"), ("streamed", "--stream-layers")):
            rc, secs, _peak, out, _rss = collect(model, work / f"{name}.npz", args, flag, "--force", dataset=data)
            assert rc == 0, out[-3000:]
            line = next((x for x in out.splitlines() if x.startswith("Wrote ")), "")
            peaks = re.findall(r"peak memory ([\d.,]+ \w+)(?:; GPU peak ([\d.,]+ \w+))?", line)
            tokens = re.findall(r"\(([\d,]+) tokens", line)
            print(f"{name}_run{rep}_seconds={secs:.1f} tokens={tokens[0] if tokens else '?'} "
                  f"{name}_host_peak={peaks[0][0] if peaks else '?'} {name}_gpu_peak={peaks[0][1] if peaks else '?'}",
                  flush=True)
            best[name] = min(best.get(name, secs), secs)
    print(f"gpu_inmem_seconds={best['inmem']:.1f} gpu_streamed_seconds={best['streamed']:.1f} "
          f"gpu_time_ratio={best['streamed'] / best['inmem']:.2f}")
    print(f"gpu_streamed_equal={str(equal(work / 'inmem.npz', work / 'streamed.npz')).lower()}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spill", action="store_true", help="the hidden states, not the weights, exceed the limit")
    ap.add_argument("--limit", help="memory cgroup limit (default 2GiB; --spill: 448MiB)")
    for name in ("layers", "experts", "hidden", "width", "samples", "tokens"):
        ap.add_argument(f"--{name}", type=int, help=f"default {SHAPES['stream'][name]}; --spill: "
                        f"{SHAPES['spill'][name]}" + (" (expert width, moe_intermediate_size)" if name == "width" else ""))
    ap.add_argument("--keep", type=Path, default=None, help="build the model here (kept) instead of a temp dir")
    ap.add_argument("--gpu-shape", action="store_true", help="the GPU row: 4-bit Qwen3-30B-A3B shape, no cgroup")
    ap.add_argument("--repeats", type=int, default=1, help="--gpu-shape: runs of each, the best kept")
    ap.add_argument("--quick", action="store_true", help="--gpu-shape with small shapes: a check of the script")
    args = ap.parse_args()
    if args.gpu_shape:
        args.samples, args.tokens = args.samples or 16, args.tokens or 2048
        args.layers = args.layers or 48
        work = Path(tempfile.mkdtemp(prefix="bench-stream-gpu-"))
        try:
            return gpu_row(work, args)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    for name, value in SHAPES["spill" if args.spill else "stream"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    work, model, limit = setup(args, "bench_stream")
    try:
        if args.spill:
            return spill(model, work, args, limit)
        limited_runs(lambda name, *flags, cgroup=None: collect(model, work / f"{name}.npz", args, *flags,
                                                               cgroup=cgroup), limit)
        print(f"streamed_equal={str(equal(work / 'inmem.npz', work / 'streamed.npz')).lower()}", flush=True)
        rc, e_mem, _p, out, ep_mem = evaluate(model, work / "eval-inmem.json", args, "--no-stream-layers")
        assert rc == 0, out
        cgroup = MemoryCgroup(limit)
        try:
            rc, e_st, ep_st, out, _rss = evaluate(model, work / "eval-streamed.json", args, cgroup=cgroup)
        finally:
            cgroup.remove()
        assert rc == 0, out
        print(f"eval_inmem_seconds={e_mem:.1f} eval_inmem_peak_rss={ep_mem} eval_streamed_seconds={e_st:.1f} "
              f"eval_streamed_peak={ep_st} eval_time_ratio={e_st / e_mem:.2f}")
        same = eval_equal(work / "eval-inmem.json", work / "eval-streamed.json")
        print(f"eval_streamed_equal={str(same).lower()}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
