#!/usr/bin/env python3
"""Export an mlx-lm qwen3_moe directory to transformers' qwen3_moe layout, for running reference code (PyTorch)
on the same model.

    python -m scripts.tools.export_transformers MODEL_DIR OUT_DIR

OUT_DIR holds ``model.safetensors`` with one tensor per expert and projection
(``model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight``, router ``model.layers.{l}.mlp.gate.weight``), a
``config.json`` for ``Qwen3MoeForCausalLM`` (transformers 4.x reads the per-expert modules; 5.x fuses them on load)
and the source's tokenizer files. A quantized source is dequantized first. ``mlx_lm.load`` reads OUT_DIR back (its
qwen3_moe ``sanitize`` stacks the experts again) and computes the same logits.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

#: the projections of one expert, as both layouts name them
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def per_expert(weights: dict) -> dict:
    """``weights`` (flat mlx-lm names) with each stacked ``mlp.switch_mlp.{proj}.weight`` [E, out, in] split into
    transformers' ``mlp.experts.{e}.{proj}.weight`` [out, in]; other names are the same in both layouts."""
    out = {}
    for name, value in weights.items():
        prefix, sep, proj = name.partition(".mlp.switch_mlp.")
        if not sep:
            out[name] = value
            continue
        kind = proj.removesuffix(".weight")
        if kind not in PROJECTIONS or not proj.endswith(".weight"):
            raise ValueError(f"unexpected expert tensor {name}")
        for e in range(value.shape[0]):
            out[f"{prefix}.mlp.experts.{e}.{kind}.weight"] = value[e]
    return out


def transformers_config(config: dict, dtype: str) -> dict:
    """The mlx-lm ``config`` as transformers' ``Qwen3MoeConfig`` reads it: architecture named, quantization gone."""
    cfg = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    cfg["architectures"] = ["Qwen3MoeForCausalLM"]
    cfg["torch_dtype"] = dtype
    cfg.setdefault("hidden_act", "silu")
    cfg.setdefault("attention_bias", False)
    return cfg


def export(src: Path, dst: Path) -> int:
    """Write ``dst`` from ``src``; the number of tensors written."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import dequantize_model, load

    model, _ = load(str(src))
    config = json.loads((src / "config.json").read_text())
    if "quantization" in config or "quantization_config" in config:
        model = dequantize_model(model)
    weights = per_expert(dict(tree_flatten(model.parameters())))
    dtype = str(weights["model.embed_tokens.weight"].dtype).removeprefix("mlx.core.")
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(transformers_config(config, dtype), indent=2) + "\n")
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model") and f.name != "config.json" and f.suffix in (
                ".json", ".txt", ".jinja", ".model"):
            shutil.copy2(f, dst / f.name)
    return len(weights)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="mlx-lm qwen3_moe model directory")
    p.add_argument("output", help="new directory to write")
    args = p.parse_args(argv)
    src, dst = Path(args.model), Path(args.output)
    if not (src / "config.json").is_file():
        print(f"Error: {src} has no config.json; give an mlx-lm model directory.", file=sys.stderr)
        return 2
    model_type = json.loads((src / "config.json").read_text()).get("model_type")
    if model_type != "qwen3_moe":
        print(f"Error: {src} is {model_type}, and only qwen3_moe is exported; give a qwen3_moe model.",
              file=sys.stderr)
        return 2
    if dst.exists() and any(dst.iterdir()):
        print(f"Error: {dst} exists and is not empty; give a new directory.", file=sys.stderr)
        return 2
    n = export(src, dst)
    print(f"wrote {dst}: {n} tensors in transformers' qwen3_moe layout")
    return 0


if __name__ == "__main__":
    sys.exit(main())
