"""scripts/tools/shard_model.py: a model split into size-capped shards (and cast) loads and computes as before."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .cli_helpers import script


def _run(*args):
    return script("tools.shard_model", *args, timeout=120)


def test_shards_under_the_cap_load_and_give_the_same_logits(make_model, tmp_path):
    from mlx_lm import load

    src = make_model("qwen3_moe")
    out = _run(src, tmp_path / "sharded", "--max-mb", "0.05")
    assert out.returncode == 0, out.stderr
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    sizes = [sum(v.nbytes for v in mx.load(str(f)).values()) for f in shards]
    alone = [f for f in shards if len(mx.load(str(f))) == 1]
    assert len(shards) > 1 and all(n <= 0.05e6 for f, n in zip(shards, sizes) if f not in alone)
    assert out.stderr.count("warning:") == sum(n > 0.05e6 for f, n in zip(shards, sizes) if f in alone)
    ids = mx.array([[5, 17, 99, 3]])
    ref = np.array(load(str(src))[0](ids))
    assert np.array_equal(np.array(load(str(tmp_path / "sharded"))[0](ids)), ref)
    half = _run(src, tmp_path / "bf16", "--dtype", "bfloat16")
    back = _run(tmp_path / "bf16", tmp_path / "f32", "--dtype", "float32", "--max-mb", "1000")
    assert half.returncode == back.returncode == 0
    got = np.array(load(str(tmp_path / "f32"))[0](ids))
    assert np.allclose(got, ref, atol=0.1) and not np.array_equal(got, ref)  # bfloat16 rounding, nothing more
    again = _run(src, tmp_path / "f32", "--max-mb", "1")
    assert again.returncode == 2 and "is not empty" in again.stderr
