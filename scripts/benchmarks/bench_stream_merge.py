"""Benchmark the layer-streamed merge (issue 43): REAM on a model larger than the memory the process may use.

    sudo python -m scripts.benchmarks.bench_stream_merge [--limit 1.25GiB] [--layers 9] [--experts 32]
                                                         [--hidden 1024] [--width 1024] [--n-prune 8] [--keep DIR]

Builds a float32 ``qwen3_moe`` with the bundled tokenizer (:func:`scripts.benchmarks.bench_stream.build`; about
3.9 GB with the defaults: 9 decoder layers of ~0.4 GB), writes an expert list merging ``--n-prune`` experts away
per layer (no saliency file: each layer's REAP comes from its captured tokens), then runs ``mlx-fun merge`` on the
bundled calibration text three times:

1. in memory (``--no-stream-layers``), without a limit: the reference model, wall time and peak RSS (the merge
   process's own);
2. in memory, in a memory cgroup of ``--limit``: killed by the limit (shown, not assumed);
3. in the same cgroup with no flag: merge sees the limit and streams the layers by itself (its note is printed);
   completes; the cgroup's peak (page cache included), the process's own peak RSS, wall time, and
   ``merged_equal`` (every safetensors file and the index byte-identical to run 1's).

Needs root for the cgroup (v1 ``/sys/fs/cgroup/memory``, or v2). Prints one ``key=value`` line per figure.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from scripts.benchmarks.bench_stream import MLX_FUN, MemoryCgroup, limited_runs, run, setup, shape_args
from scripts.lib.paths import CALIBRATION


def merge(model: Path, experts: Path, out: Path, *extra: str, cgroup: MemoryCgroup | None = None):
    """One ``mlx-fun merge`` child (:func:`scripts.benchmarks.bench_stream.run`)."""
    return run([*MLX_FUN, "merge", "--model", str(model), "--expert-list", str(experts), "--dataset", str(CALIBRATION),
                "--output", str(out), "--max-samples", "8", "--max-tokens", "256", "--seed", "0", *extra], cgroup)


def weights(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir()) if "safetensors" in f.name}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shape_args(ap, limit="1.25GiB", experts=32)
    ap.add_argument("--n-prune", type=int, default=8, help="experts merged away per layer")
    args = ap.parse_args()
    work, model, limit = setup(args, "bench_stream_merge")
    try:
        experts = work / "experts.json"
        kept = list(range(args.experts - args.n_prune))
        experts.write_text(json.dumps({"format": "mlx-fun-expert-list",
                                       "layers": {str(i): {"keep": kept} for i in range(args.layers)}}))
        limited_runs(lambda name, *flags, cgroup=None: merge(model, experts, work / name, *flags, cgroup=cgroup),
                     limit)
        same = weights(work / "inmem") == weights(work / "streamed")
        print(f"merged_equal={str(same).lower()} checkpoint_left={(work / '.streamed.stream').exists()}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
