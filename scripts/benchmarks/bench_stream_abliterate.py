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
   printed); completes; its own peak RSS, the cgroup's peak (page cache included: a run that
   reads every layer again per pass fills the cgroup with page cache up to its limit, which the kernel reclaims),
   wall time, and ``streamed_equal`` (every written file but the model card byte-identical to run 1's: weights, index, config,
   ``abliteration_metadata.json`` with its directions, refusal rates and KL).

Needs root for the cgroup (v1 ``/sys/fs/cgroup/memory``, or v2). Prints one ``key=value`` line per figure.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from scripts.benchmarks.bench_stream import MLX_FUN, MemoryCgroup, limited_runs, run, setup, shape_args
from scripts.lib.paths import SAFETY


def abliterate(model: Path, out: Path, args, *extra: str, cgroup: MemoryCgroup | None = None):
    """One ``mlx-fun abliterate`` child (:func:`scripts.benchmarks.bench_stream.run`)."""
    return run([*MLX_FUN, "abliterate", "--model", str(model), "--harmful-dataset", str(SAFETY / "harmful_train.jsonl"),
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
    shape_args(ap, limit="736MiB", experts=16)
    ap.add_argument("--samples", type=int, default=4, help="capture and evaluation prompts per set")
    args = ap.parse_args()
    work, model, limit = setup(args, "bench_stream_abliterate")
    try:
        limited_runs(lambda name, *flags, cgroup=None: abliterate(model, work / name, args, *flags, cgroup=cgroup),
                     limit)
        print(f"streamed_equal={str(same_files(work / 'inmem', work / 'streamed')).lower()}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
