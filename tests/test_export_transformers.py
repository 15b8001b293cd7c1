"""scripts/tools/export_transformers.py: the per-expert transformers layout, read back by mlx_lm, computes the same
logits as the source."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np

from .cli_helpers import script


def _run(*args):
    return script("tools.export_transformers", *args, timeout=120)


def test_export_reads_back_with_identical_logits(make_model, tmp_path):
    from mlx_lm import load

    src = make_model("qwen3_moe")
    out = _run(src, tmp_path / "tf")
    assert out.returncode == 0, out.stderr
    config = json.loads((src / "config.json").read_text())
    names = mx.load(str(tmp_path / "tf" / "model.safetensors"))
    n, layers = config["num_experts"], config["num_hidden_layers"]
    assert not any("switch_mlp" in k for k in names)
    for layer in range(layers):
        assert names[f"model.layers.{layer}.mlp.gate.weight"].shape == (n, config["hidden_size"])
        for e in (0, n - 1):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" in names
    exported = json.loads((tmp_path / "tf" / "config.json").read_text())
    assert exported["architectures"] == ["Qwen3MoeForCausalLM"] and exported["torch_dtype"] == "float32"
    assert (tmp_path / "tf" / "tokenizer.json").is_file()
    ids = mx.array([[5, 17, 99, 3, 250, 7]])
    ref = np.array(load(str(src))[0](ids))
    assert np.array_equal(np.array(load(str(tmp_path / "tf"))[0](ids)), ref)
    again = _run(src, tmp_path / "tf")
    assert again.returncode == 2 and again.stderr.strip().endswith("exists and is not empty; give a new directory.")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"model_type": "mixtral"}')
    other = _run(tmp_path / "other", tmp_path / "tf2")
    assert other.returncode == 2 and "only qwen3_moe is exported" in other.stderr and not (tmp_path / "tf2").exists()
