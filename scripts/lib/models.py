"""Benchmark models: the Qwen3-30B-A3B shape with random weights, and random saliency statistics for one."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from .paths import BUNDLED
from .procs import root_env


def gpu_shape(*, layers: int, vocab: int, quick: bool = False):
    """``(model, config, adapter)``: a Qwen3-30B-A3B-shaped ``qwen3_moe`` built in memory by mlx-lm's own classes
    (hidden 2048, 32 query / 4 KV heads of 128, 128 experts top-8 of width 768, ``layers`` decoder layers), random
    weights (seeded), bfloat16, quantized by mlx-lm's ``quantize_model`` to 4-bit affine, group 64; ``quick``: small
    shapes, a check of a script itself."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes, quantize_model

    from mlx_fun.adapters import get_adapter
    from mlx_fun.testing.tiny import tiny_config

    shape = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                 num_experts_per_tok=8, num_hidden_layers=layers, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, rope_theta=1e6)
    if quick:
        shape.update(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=32,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    config = tiny_config("qwen3_moe", vocab_size=vocab, **shape)
    mx.random.seed(0)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    model.set_dtype(mx.bfloat16)
    model, config = quantize_model(model, config, 64, 4, mode="affine")
    for part in (model.model.embed_tokens, model.lm_head, *model.model.layers):  # one layer at a time in memory
        mx.eval(part.parameters())
    mx.eval(model.parameters())
    return model, config, get_adapter(model, config)


def save_with_bundled_tokenizer(model, config: dict, out: Path) -> Path:
    """``model`` saved as an mlx-lm directory ``out`` with the bundled model's tokenizer files."""
    from mlx_lm.utils import save_config, save_model

    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    save_config(config, config_path=out / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (BUNDLED / name).is_file():
            shutil.copy(BUNDLED / name, out / name)
    return out


#: Python run in a child process (argv: model directory, output .npz[, seed]): random REAP statistics of the right
#: shape (no collect run); prints the layers, the experts and the MoE layer indices
RANDOM_SALIENCY = """
import sys
import numpy as np
from mlx_fun.adapters import get_adapter
from mlx_fun.model.io import load_model
from mlx_fun.observe.saliency import SaliencyAccumulator
model, _, config = load_model(sys.argv[1], lazy=True)
acc = SaliencyAccumulator.for_adapter(get_adapter(model, config))
rng = np.random.default_rng(int(sys.argv[3]) if len(sys.argv) > 3 else 0)
shape = (acc.num_layers, acc.num_experts)
acc.freq[...] = rng.integers(50, 500, shape)
acc.reap_count[...] = acc.freq
acc.weighted_freq_sum[...] = acc.freq * rng.uniform(0.05, 0.3, shape)
acc.ean_sum[...] = acc.freq * rng.uniform(0.5, 2.0, shape)
acc.reap_sum[...] = acc.ean_sum * rng.uniform(0.05, 0.3, shape)
acc.max_activation_norm[...] = rng.uniform(2.0, 4.0, shape)
acc.total_tokens = int(acc.freq.sum()) // acc.top_k
acc.save(sys.argv[2])
print(acc.num_layers, acc.num_experts, acc.moe_layer_indices)
"""


def random_saliency(model: Path, out: Path, *, seed: int = 0) -> Path:
    """:data:`RANDOM_SALIENCY` for ``model``, written to ``out`` by a child Python (the run's output on failure)."""
    proc = subprocess.run([sys.executable, "-c", RANDOM_SALIENCY, str(model), str(out), str(seed)], env=root_env(),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit("writing the saliency file failed")
    return out
