"""Benchmark the layer-streamed merge (issue 43): REAM on a model larger than the memory the process may use.

    sudo python -m scripts.benchmarks.bench_stream_merge [--limit 1.25GiB] [--layers 9] [--experts 32]
                                                         [--hidden 1024] [--width 1024] [--n-prune 8] [--keep DIR]

Builds a float32 ``qwen3_moe`` with the bundled tokenizer (:func:`scripts.benchmarks.bench_stream.build`; about
3.9 GB with the defaults: 9 decoder layers of ~0.4 GB), writes an expert list merging ``--n-prune`` experts away
per layer (no saliency file: each layer's REAP comes from its captured tokens), then runs ``mlx-fun merge`` on the
bundled calibration text three times:

1. in memory (``--no-stream-layers``), without a limit: the reference model, wall time and peak RSS (GNU
   ``time``'s, of the merge process alone);
2. in memory, in a memory cgroup of ``--limit``: killed by the limit (shown, not assumed);
3. in the same cgroup with no flag: merge sees the limit and streams the layers by itself (its note is printed);
   completes; the cgroup's peak (page cache included), the process's own peak RSS, wall time, and
   ``merged_equal`` (every safetensors file and the index byte-identical to run 1's).

Needs root for the cgroup (v1 ``/sys/fs/cgroup/memory``, or v2). Prints one ``key=value`` line per figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from scripts.benchmarks.bench_stream import MLX_FUN, MemoryCgroup, build, parse_bytes, run
from scripts.lib.paths import CALIBRATION


def merge(model: Path, experts: Path, out: Path, *extra: str, cgroup: MemoryCgroup | None = None):
    """One ``mlx-fun merge`` child (:func:`scripts.benchmarks.bench_stream.run`) under GNU ``time``, which adds the
    child's own peak RSS to its stderr (``maxrss_kib=``)."""
    return run(["/usr/bin/time", "-f", "maxrss_kib=%M", MLX_FUN, "merge", "--model", str(model), "--expert-list", str(experts), "--dataset",
                str(CALIBRATION), "--output", str(out), "--max-samples", "8", "--max-tokens", "256", "--seed", "0",
                *extra], cgroup)


def own_peak(stderr: str) -> int:
    """The merge process's own peak RSS in bytes (GNU ``time``'s line), 0 where it printed none."""
    found = re.findall(r"^maxrss_kib=(\d+)$", stderr, re.M)
    return int(found[-1]) * 1024 if found else 0


def weights(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir()) if "safetensors" in f.name}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", default="1.25GiB", help="memory cgroup limit of runs 2 and 3 (default 1.25GiB)")
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1024, help="expert width (moe_intermediate_size)")
    ap.add_argument("--n-prune", type=int, default=8, help="experts merged away per layer")
    ap.add_argument("--keep", type=Path, default=None, help="build the model here (kept) instead of a temp dir")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_stream_merge needs root for its memory cgroup; run it with sudo.")
    limit = parse_bytes(args.limit)
    work = Path(tempfile.mkdtemp(prefix="bench-stream-merge-"))
    try:
        model = args.keep or work / "model"
        if not (model / "config.json").exists():
            build(model, args)
        experts = work / "experts.json"
        kept = list(range(args.experts - args.n_prune))
        experts.write_text(json.dumps({"format": "mlx-fun-expert-list",
                                       "layers": {str(i): {"keep": kept} for i in range(args.layers)}}))
        size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        print(f"weights_bytes={size} limit_bytes={limit} ratio={size / limit:.2f}", flush=True)
        rc, s_mem, _peak, err = merge(model, experts, work / "inmem", "--no-stream-layers")
        assert rc == 0, err
        print(f"inmem_seconds={s_mem:.1f} inmem_peak_rss={own_peak(err)}", flush=True)
        cgroup = MemoryCgroup(limit)
        try:
            rc, _s, p, err = merge(model, experts, work / "limited", "--no-stream-layers", cgroup=cgroup)
            print(f"inmem_limited_returncode={rc} inmem_limited_killed={str(rc < 0 or rc == 137).lower()} "
                  f"inmem_limited_peak={p}", flush=True)
            rc, s_st, p_st, err = merge(model, experts, work / "streamed", cgroup=cgroup)
            assert rc == 0, err
            notes = [line for line in err.splitlines() if "streaming the layers" in line]
            print(f"streamed_seconds={s_st:.1f} streamed_cgroup_peak={p_st} streamed_peak_rss={own_peak(err)} "
                  f"streamed_time_ratio={s_st / s_mem:.2f}")
            print(f"streamed_auto_note={notes[:1]}")
            same = weights(work / "inmem") == weights(work / "streamed")
            print(f"merged_equal={str(same).lower()} checkpoint_left={(work / '.streamed.stream').exists()}",
                  flush=True)
        finally:
            cgroup.remove()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
