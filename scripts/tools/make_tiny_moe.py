#!/usr/bin/env python3
"""Make a tiny random MoE model of any supported family, saved as an mlx-lm directory.

    python -m scripts.tools.make_tiny_moe --model-type qwen3_moe --output ./tiny-qwen3 [--bits 4]

The byte-level BPE tokenizer (with a chat template) is trained locally on standard-library text; nothing is
downloaded. The test suite builds its fixtures with the same code (``mlx_fun.testing.tiny``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from mlx_fun.testing.tiny import QUANT_MODES, make_tiny_model, tiny_model_types  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-type", required=True, choices=tiny_model_types(), metavar="TYPE",
                   help=f"family to build: {', '.join(tiny_model_types())}")
    p.add_argument("--output", required=True, help="directory to write (replaced atomically if it exists)")
    p.add_argument("--bits", type=int, choices=(2, 3, 4, 5, 6, 8), default=None, help="quantize (affine)")
    p.add_argument("--mode", choices=sorted(QUANT_MODES), default="affine", help="quantization mode")
    p.add_argument("--group-size", type=int, default=None, help="quantization group size (default per mode)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default=None, help="JSON object of config overrides, e.g. '{\"num_experts\": 16}'")
    args = p.parse_args(argv)
    overrides = json.loads(args.config) if args.config else {}
    out = make_tiny_model(args.model_type, args.output, bits=args.bits, mode=args.mode,
                          group_size=args.group_size, seed=args.seed, **overrides)
    size = sum(f.stat().st_size for f in Path(out).iterdir())
    quant = "float" if args.bits is None and args.mode == "affine" else f"{args.mode} {args.bits or 4}-bit"
    if args.mode in ("mxfp4", "nvfp4"):
        quant = args.mode
    print(f"wrote {out} ({args.model_type}, {quant}, {size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
