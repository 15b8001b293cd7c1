"""Pruning: slicing the expert axis of every family and quantization mode, saving, reloading with plain mlx_lm."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from mlx_fun.model import moe_hook
from mlx_fun.adapters import get_adapter
from mlx_fun.errors import UserError
from mlx_fun.model.io import load_model
from mlx_fun.output.model_dir import save_model_dir
from mlx_fun.rewrite.prune import prune_model

from .conftest import FAMILIES

PROMPT = [[5, 17, 99]]  # 3 tokens × top-2 use at most 6 of the 8 experts, so 2 can always be pruned around them
# families whose routing weights do not depend on the experts outside the chosen top-k
# (renormalised, or softmax over the chosen logits): pruning unchosen experts leaves every layer's output intact
WEIGHTS_INVARIANT = {"minimax", "minimax_m2", "mixtral", "gpt_oss", "qwen3_moe", "qwen3_next", "qwen3_5_moe",
                     "deepseek_v3", "kimi_k2", "kimi_k25", "deepseek_v32", "glm4_moe", "glm4_moe_lite",
                     "glm_moe_dsa", "dots1"}  # fmt: skip


def _logits(model, tokens=PROMPT):
    out = model(mx.array(tokens))
    mx.eval(out)
    return np.array(out)


def _routing(adapter, tokens=PROMPT):
    rec = {}
    with moe_hook.hooked(adapter, [lambda layer, i, w, lg, y: rec.__setitem__(layer, np.array(i))]):
        mx.eval(adapter.model(mx.array(tokens)))
    return rec


CASES = [(mt, None, "affine") for mt in FAMILIES] + [(mt, 4, "affine") for mt in FAMILIES] + [
    ("qwen3_moe", None, "mxfp4"), ("gpt_oss", None, "mxfp4"), ("qwen3_moe", None, "nvfp4"),
    ("mixtral", 8, "affine"), ("deepseek_v3", 2, "affine"),
]  # fmt: skip


@pytest.mark.parametrize("model_type,bits,mode", CASES, ids=lambda v: str(v))
def test_pruned_dir_loads_with_plain_mlx_lm(tmp_path, make_model, model_type, bits, mode):
    src = make_model(model_type, bits=bits, mode=mode, n_group=1, topk_group=1) if model_type in (
        "deepseek_v3", "deepseek_v32") else make_model(model_type, bits=bits, mode=mode)
    model, _, config = load_model(src)
    adapter = get_adapter(model, config)
    E = adapter.num_experts
    ref = _logits(model)

    # pruning nothing changes nothing
    same = prune_model(adapter, {p: list(range(E)) for p in range(len(adapter.moe_layers()))})
    assert np.array_equal(_logits(model), ref) and same == config

    # keep every expert the router chose on PROMPT (plus others up to E-2): routing is unchanged
    chosen = _routing(adapter)
    keep_map = {}
    for pos, inds in chosen.items():
        must = sorted(set(inds.reshape(-1).tolist()))
        rest = [e for e in range(E) if e not in must]
        keep_map[pos] = sorted(must + rest[: max(0, E - 2 - len(must))])
    n_keep = len(keep_map[0])
    assert n_keep == E - 2 and all(len(k) == n_keep for k in keep_map.values())
    new_config = prune_model(adapter, keep_map)
    assert adapter.num_experts == n_keep
    key = adapter.config_keys()[0]
    node = new_config
    for k in key:
        node = node[k]
    assert node == n_keep
    pruned_logits = _logits(model)
    after = _routing(adapter)
    check = after if model_type in WEIGHTS_INVARIANT else {0: after[0]}
    for pos, inds in check.items():
        mapped = np.array(keep_map[pos])[inds]
        assert np.array_equal(np.sort(mapped, -1), np.sort(chosen[pos], -1)), f"layer {pos} routes differently"
    if model_type in WEIGHTS_INVARIANT:
        np.testing.assert_allclose(pruned_logits, ref, rtol=1e-4, atol=1e-4)

    out = save_model_dir(model, new_config, tmp_path / "pruned", source=src,
                         metadata={"reap_metadata.json": {"keep_map": {str(k): v for k, v in keep_map.items()}}})
    assert (out / "tokenizer.json").exists() and (out / "reap_metadata.json").exists()
    reloaded, tok = mlx_lm.load(str(out))
    assert np.array_equal(_logits(reloaded), pruned_logits)
    assert json.loads((out / "reap_metadata.json").read_text())["keep_map"]["0"] == keep_map[0]


def test_group_divisibility_enforced(make_model):
    model, _, config = load_model(make_model("deepseek_v3"))  # n_group 4, 8 experts
    adapter = get_adapter(model, config)
    with pytest.raises(UserError, match="divisible by 4"):
        prune_model(adapter, {0: [0, 1, 2, 3, 4, 5], 1: [0, 1, 2, 3, 4, 5]})
    # one expert per group divides evenly, but the router scores a group by its top two: mlx-lm would crash
    # in topk(k=2) on the pruned model, so it is refused up front
    with pytest.raises(UserError, match="every group must keep at least 2"):
        prune_model(adapter, {0: [0, 2, 4, 6], 1: [0, 2, 4, 6]})
    # divisible, but groups 2 and 3 would lose every expert: their tokens would move to other groups
    with pytest.raises(UserError, match=r"keeps \[2, 2, 0, 0\] experts of its 4 router groups"):
        prune_model(adapter, {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]})


def test_keep_map_must_be_uniform_and_valid(make_model):
    model, _, config = load_model(make_model("qwen3_moe"))
    adapter = get_adapter(model, config)
    with pytest.raises(UserError, match="same number of experts"):
        prune_model(adapter, {0: [0, 1, 2], 1: [0, 1, 2, 3]})
    with pytest.raises(UserError, match="distinct values"):
        prune_model(adapter, {0: [0, 0, 1], 1: [0, 1, 2]})


def test_save_refuses_input_and_nonempty_dirs(tmp_path, make_model):
    src = make_model("mixtral")
    model, _, config = load_model(src)
    # called from Python, messages name keyword arguments (the CLI names flags: --model, --force)
    with pytest.raises(UserError, match="is the input given to model="):
        save_model_dir(model, config, src, source=src)
    with pytest.raises(UserError, match="is inside the input model="):
        save_model_dir(model, config, src / "inside", source=src)
    with pytest.raises(UserError, match="contains the input model="):
        save_model_dir(model, config, src.parent, source=src, force=True)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="pass force= to replace it"):
        save_model_dir(model, config, busy, source=src)
    assert (busy / "keep.txt").read_text() == "mine"
    save_model_dir(model, config, busy, source=src, force=True)
    assert not (busy / "keep.txt").exists() and (busy / "config.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
