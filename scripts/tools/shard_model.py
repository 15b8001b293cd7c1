#!/usr/bin/env python3
"""Rewrite a model directory's weights in shards of at most --max-mb (optionally cast), for moving a model through
a channel with a per-file limit (the lent GPU machines return files of at most 16 MiB each).

    python -m scripts.tools.shard_model MODEL_DIR OUT_DIR [--dtype bfloat16] [--max-mb 14]

``mlx_lm.load`` reads every ``model*.safetensors`` of a directory, so OUT_DIR loads as MODEL_DIR does (config.json,
tokenizer and card files are copied; ``torch_dtype`` follows ``--dtype``). On the CPU, cast back to float32 before
running MoE layers (MLX's CPU ``gather_mm`` is float32-only): ``--dtype float32 --max-mb 100000``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path


def size_of(shard: dict) -> int:
    return sum(v.nbytes for v in shard.values())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("output")
    p.add_argument("--dtype", default=None, help="cast floating weights to this (bfloat16, float16, float32)")
    p.add_argument("--max-mb", type=float, default=14.0)
    args = p.parse_args()
    import mlx.core as mx

    src, dst = Path(args.model), Path(args.output)
    if dst.exists() and any(dst.iterdir()):
        print(f"Error: {dst} exists and is not empty; give a new directory.", file=sys.stderr)
        return 2
    dst.mkdir(parents=True, exist_ok=True)
    weights = {}
    for f in sorted(src.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    dtype = getattr(mx, args.dtype) if args.dtype else None
    limit, shards, current, size = args.max_mb * 1e6, [], {}, 0
    for key in sorted(weights):
        v = weights[key]
        if dtype is not None and mx.issubdtype(v.dtype, mx.floating):
            v = v.astype(dtype)
        if current and size + v.nbytes > limit:
            shards.append(current)
            current, size = {}, 0
        current[key] = v
        size += v.nbytes
    shards.append(current)
    for shard in shards:
        if len(shard) == 1 and size_of(shard) > limit:
            print(f"warning: {next(iter(shard))} alone is {size_of(shard) / 1e6:.1f} MB, over --max-mb "
                  f"{args.max_mb:g}: its shard is that large", file=sys.stderr)
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        mx.save_safetensors(str(dst / name), shard, metadata={"format": "mlx"})
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model") and f.suffix in (".json", ".md", ".txt", ".jinja"):
            shutil.copy2(f, dst / f.name)
    if args.dtype and (dst / "config.json").exists():
        cfg = json.loads((dst / "config.json").read_text())
        cfg["torch_dtype"] = args.dtype
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    print(f"wrote {len(shards)} shard(s) to {dst}: " + ", ".join(f"{size_of(s) / 1e6:.1f} MB" for s in shards))
    return 0


if __name__ == "__main__":
    sys.exit(main())
