"""Benchmark ``abliterate --stream-layers`` (issue 43): a model larger than the memory the process may use.

    sudo python -m scripts.benchmarks.bench_stream_abliterate [--limit 736MiB] [--layers 9] [--experts 16]
                                                              [--hidden 1024] [--width 1024] [--samples 4] [--keep DIR]

Builds a float32 ``qwen3_moe`` with the bundled tokenizer (about 2 GB with the defaults: 9 decoder layers of
~0.22 GB; :func:`scripts.benchmarks.bench_stream.build`), then runs ``mlx-fun abliterate`` on the bundled safety
prompts (``--no-refusal-filter``: a random model refuses nothing; ``--samples`` capture and evaluation prompts per
set, one round, the default 16-token replies) three times:

1. in memory, without a limit: the reference model directory, wall time and peak RSS;
2. in memory (``--no-stream-layers``), in a memory cgroup of ``--limit``: killed by the limit (shown, not assumed);
3. in the same cgroup with no flag: abliterate sees the limit and streams the layers by itself (its note is
   printed); completes; its own peak RSS (the one it prints), the cgroup's peak (page cache included: a run that
   reads every layer again per pass fills the cgroup with page cache up to its limit, which the kernel reclaims),
   wall time, and ``streamed_equal`` (every written file but the model card byte-identical to run 1's: weights, index, config,
   ``abliteration_metadata.json`` with its directions, refusal rates and KL).

Needs root for the cgroup (v1 ``/sys/fs/cgroup/memory``, or v2). Prints one ``key=value`` line per figure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from scripts.benchmarks.bench_stream import MLX_FUN, MemoryCgroup, build, parse_bytes
from scripts.lib.paths import SAFETY
from scripts.lib.procs import root_env


def run(cmd: list[str], cgroup: MemoryCgroup | None):
    """``(returncode, seconds, the cgroup's peak or None, the peak RSS the command printed or None, stderr)``."""
    import re
    import subprocess
    import time

    from mlx_fun.core.sizes import parse_bytes as parse

    if cgroup is not None:
        cgroup.reset()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=root_env(), capture_output=True, text=True,
                          preexec_fn=cgroup.join if cgroup is not None else None)
    seconds = time.perf_counter() - t0
    said = re.search(r"peak memory ([0-9.]+ [KMGT]?i?B)", proc.stdout)
    printed = parse(said.group(1).replace(" ", "")) if said else None
    return proc.returncode, seconds, cgroup.peak() if cgroup is not None else None, printed, proc.stderr


def abliterate(model: Path, out: Path, args, *extra: str, cgroup: MemoryCgroup | None = None):
    """One ``mlx-fun abliterate`` child (:func:`run`)."""
    return run([MLX_FUN, "abliterate", "--model", str(model), "--harmful-dataset", str(SAFETY / "harmful_train.jsonl"),
                "--benign-dataset", str(SAFETY / "benign_train.jsonl"), "--output", str(out), "--no-refusal-filter",
                "--max-samples", str(args.samples), "--eval-samples", str(args.samples), "--rounds", "1",
                "--seed", "0", *extra], cgroup)


def same_files(a: Path, b: Path) -> bool:
    """Every file of two written models but the card (which names its own output) byte-identical."""
    names = sorted(p.name for p in a.iterdir() if p.name != "README.md")
    return names == sorted(p.name for p in b.iterdir() if p.name != "README.md") and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", default="736MiB", help="memory cgroup limit of runs 2 and 3 (default 736MiB)")
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1024, help="expert width (moe_intermediate_size)")
    ap.add_argument("--samples", type=int, default=4, help="capture and evaluation prompts per set")
    ap.add_argument("--keep", type=Path, default=None, help="build the model here (kept) instead of a temp dir")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_stream_abliterate needs root for its memory cgroup; run it with sudo.")
    limit = parse_bytes(args.limit)
    work = Path(tempfile.mkdtemp(prefix="bench-stream-abl-"))
    try:
        model = args.keep or work / "model"
        if not (model / "config.json").exists():
            build(model, args)
        weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        print(f"weights_bytes={weights} limit_bytes={limit} ratio={weights / limit:.2f}", flush=True)
        rc, s_mem, _, p_mem, err = abliterate(model, work / "inmem", args, "--no-stream-layers")
        assert rc == 0, err
        print(f"inmem_seconds={s_mem:.1f} inmem_peak_rss={p_mem}", flush=True)
        cgroup = MemoryCgroup(limit)
        try:
            rc, _s, p, _, err = abliterate(model, work / "limited", args, "--no-stream-layers", cgroup=cgroup)
            killed = rc in (-9, 137) or rc < 0
            print(f"inmem_limited_returncode={rc} inmem_limited_killed={str(killed).lower()} "
                  f"inmem_limited_peak={p}", flush=True)
            rc, s_st, p_st, rss_st, err = abliterate(model, work / "streamed", args, cgroup=cgroup)
            assert rc == 0, err
            notes = [line for line in err.splitlines() if "streaming the layers" in line]
            print(f"streamed_seconds={s_st:.1f} streamed_peak_rss={rss_st} streamed_cgroup_peak={p_st} "
                  f"streamed_time_ratio={s_st / s_mem:.2f}")
            print(f"streamed_auto_note={notes[:1]}")
            print(f"streamed_equal={str(same_files(work / 'inmem', work / 'streamed')).lower()}", flush=True)
        finally:
            cgroup.remove()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
