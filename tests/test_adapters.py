"""Adapters replay each family's routing exactly; the hooked MoE call equals the unhooked one."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_fun.model import moe_hook
from mlx_fun.adapters import ALIASES, REGISTRY, get_adapter, supported_model_types
from mlx_fun.adapters.base import expert_projections
from mlx_fun.errors import UserError
from mlx_fun.model.io import load_model

from .conftest import FAMILIES

REQUIRED = {
    "minimax", "minimax_m2", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "deepseek_v3", "kimi_k2",
    "deepseek_v32", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "gpt_oss", "mixtral", "olmoe", "qwen2_moe",
}  # fmt: skip

# (prompt batch, whether it is large enough for SwitchGLU to take its sorted path: indices.size >= 64)
SMALL = [[5, 17, 99, 3, 250]]  # 5 tokens × k=2 = 10 indices: unsorted gather path
LARGE = [list(range(7, 47)), list(range(300, 340))]  # 80 tokens × 2 = 160 indices: sorted path


def _load(make_model, model_type, bits, **overrides):
    model, tok, config = load_model(make_model(model_type, bits=bits, **overrides))
    return model, config, get_adapter(model, config)


class _Recorder:
    """Swap a module's class for a subclass that records its inputs/outputs (test-only spy)."""

    def __init__(self, module, log):
        self.module, self.original = module, type(module)

        def call(this, *args):
            out = self.original.__call__(this, *args)
            log.append((args, out))
            return out

        module.__class__ = type("Rec" + self.original.__name__, (self.original,), {"__call__": call})

    def undo(self):
        self.module.__class__ = self.original


def _record_blocks(model, adapter, tokens):
    """Run the unhooked model; return per MoE block (route_in, combine_in, moe_out, expert_inds, expert_y): what
    the router sees, what the combine sees, the MoE output, and the experts' own indices and outputs. A block is
    one call ``block(x)``; a ``split_router`` family's decoder layer calls ``router(x)`` and
    ``experts(x2, inds, weights)`` itself."""
    route_logs, moe_logs, expert_logs, recs = [], [], [], []
    for block in adapter.blocks():
        for logs in (route_logs, moe_logs, expert_logs):
            logs.append([])
        if adapter.split_router:
            recs.append(_Recorder(adapter.router(block), route_logs[-1]))
            recs.append(_Recorder(adapter.expert_caller(block), moe_logs[-1]))
        else:
            recs.append(_Recorder(block, moe_logs[-1]))
        recs.append(_Recorder(adapter.experts(block), expert_logs[-1]))
    try:
        mx.eval(model(mx.array(tokens)))
    finally:
        for r in recs:
            r.undo()
    out = []
    for block, rlog, mlog, elog in zip(adapter.blocks(), route_logs, moe_logs, expert_logs):
        args, moe_out = mlog[0]
        (_, inds), y = elog[0]
        if adapter.split_router:
            route_in, combine_in = rlog[0][0][0], args[0]
        else:
            route_in = combine_in = adapter.prepare(block, args[0])
        out.append((route_in, combine_in, moe_out, inds, y))
    return out


def test_registry_covers_required_families():
    assert REQUIRED <= set(supported_model_types())


def test_every_mlx_lm_moe_model_type_is_supported_or_listed_with_a_reason():
    from mlx_fun.adapters import UNSUPPORTED

    from mlx_fun.adapters.coverage import mlx_lm_moe_types, unknown_moe_types

    modules, reusers = mlx_lm_moe_types()
    assert len(modules) >= 40 and {"qwen3_moe", "gemma4_text", "nemotron_h"} <= set(modules)  # the scan finds them
    assert {"gemma4", "qwen3_5_moe", "qwen3_vl_moe"} <= set(reusers) and "llama" not in modules + reusers
    missing = unknown_moe_types()
    assert not missing, f"mlx-lm MoE model types neither supported nor listed in adapters.UNSUPPORTED: {missing}"
    assert all(len(reason) > 20 for reason in UNSUPPORTED.values())
    assert not set(UNSUPPORTED) & set(REGISTRY)
    from mlx_lm.utils import MODEL_REMAPPING  # an alias of a supported type is supported too

    unserved = [a for a, t in MODEL_REMAPPING.items() if t in REGISTRY and a not in REGISTRY]
    assert not unserved, f"mlx-lm aliases of supported types missing from adapters.ALIASES: {unserved}"
    for alias, target in ALIASES.items():
        assert MODEL_REMAPPING[alias] == target and REGISTRY[alias] is REGISTRY[target]


def test_every_supported_type_has_a_tiny_config():
    from mlx_fun.testing.tiny import tiny_model_types

    assert set(FAMILIES) <= set(tiny_model_types())


def test_unsupported_model_type_names_its_reason():
    with pytest.raises(UserError, match=r"'longcat_flash' is not supported: the router also picks zero-computation"):
        get_adapter(None, {"model_type": "longcat_flash"})


def test_unsupported_model_type_lists_supported():
    with pytest.raises(UserError) as e:
        get_adapter(None, {"model_type": "llama"})
    msg = str(e.value)
    assert "llama" in msg and "qwen3_moe" in msg and "gpt_oss" in msg


@pytest.mark.parametrize("bits", [None, 4], ids=["float", "4bit"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_route_replays_block_exactly(make_model, model_type, bits):
    model, config, adapter = _load(make_model, model_type, bits)
    for tokens in (SMALL, LARGE):
        for pos, (x, h, block_out, inds_ref, y_ref) in enumerate(_record_blocks(model, adapter, tokens)):
            block = adapter.blocks()[pos]
            inds, weights, logits = adapter.route(block, x)
            assert inds.shape == inds_ref.shape
            assert np.array_equal(np.array(inds), np.array(inds_ref)), f"layer {pos}: indices differ"
            assert logits.shape[-1] == adapter.num_experts
            # the combine with our weights reproduces the block output bit for bit
            out = adapter.combine(block, h, y_ref, weights).reshape(block_out.shape)
            assert np.array_equal(np.array(out), np.array(block_out)), f"layer {pos}: combine differs"
            if adapter.weights_at_input or y_ref.shape[-1] != block_out.shape[-1]:
                continue  # weights applied to the experts' input, or experts in a latent space: the combine check is it
            # weights, checked independently: solve block_out - shared = Σ_k w_k y_k per token
            D = block_out.shape[-1]
            shared = adapter.combine(block, h, y_ref, mx.zeros_like(weights)).reshape(-1, D)
            target = np.array(block_out.reshape(-1, D) - shared, dtype=np.float64)
            Y = np.array(y_ref.reshape(-1, adapter.top_k, y_ref.shape[-1]), dtype=np.float64)
            W = np.array(adapter.mixing_weights(block, h, weights).reshape(-1, adapter.top_k), dtype=np.float64)
            for t in range(0, len(Y), 7):
                sol, *_ = np.linalg.lstsq(Y[t].T, target[t], rcond=None)
                np.testing.assert_allclose(sol, W[t], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v32", "glm4_moe", "exaone_moe", "mimo_v2_flash"])
def test_group_limited_routing_with_correction_bias(make_model, model_type):
    """n_group > 1 (only topk_group groups may be chosen) and a non-zero e_score_correction_bias."""
    model, config, adapter = _load(make_model, model_type, None, n_group=4, topk_group=2)
    assert adapter.groups == (4, 2)
    block = adapter.blocks()[0]
    assert np.abs(np.array(block.gate.e_score_correction_bias)).max() > 0
    (x, _, _, inds_ref, _), *_ = _record_blocks(model, adapter, LARGE)
    inds, _, _ = adapter.route(block, x)
    assert np.array_equal(np.array(inds), np.array(inds_ref))
    groups = np.array(inds) // (adapter.num_experts // 4)
    assert max(len(set(row)) for row in groups.reshape(-1, adapter.top_k)) <= 2


@pytest.mark.parametrize("bits", [None, 4], ids=["float", "4bit"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_hooked_equals_unhooked_and_remove_restores(make_model, model_type, bits):
    model, config, adapter = _load(make_model, model_type, bits)
    classes = [type(b) for b in adapter.blocks()]
    for tokens in (SMALL, LARGE):
        ids = mx.array(tokens)
        ref = model(ids)
        seen = []
        with moe_hook.hooked(adapter, [lambda layer, i, w, lg, y: seen.append((layer, i.shape, y.shape))]):
            assert all(moe_hook.is_hooked(b) for b in adapter.blocks())
            out = model(ids)
        assert np.array_equal(np.array(ref), np.array(out))
        assert [s[0] for s in seen] == list(range(len(adapter.moe_layers())))
        assert all(s[2][-2] == adapter.top_k for s in seen)
    assert [type(b) for b in adapter.blocks()] == classes
    assert not any(moe_hook.is_hooked(b) for b in adapter.blocks())


@pytest.mark.parametrize("model_type", FAMILIES)
def test_steering_through_the_hook(make_model, model_type):
    from mlx_fun.adapters.steer import RouteSteer

    model, config, adapter = _load(make_model, model_type, None)
    E = adapter.num_experts
    boost = RouteSteer.build("additive", E, [3], [], -1e9, 1e4)  # group-limited too: the selection score is boosted
    chosen = []
    bias = {pos: boost for pos in range(len(adapter.moe_layers()))}
    with moe_hook.hooked(adapter, [lambda layer, i, w, lg, y: chosen.append(np.array(i))], steer=bias):
        mx.eval(model(mx.array(SMALL)))
    assert len(chosen) == len(adapter.moe_layers())
    for inds in chosen:
        assert (inds.reshape(-1, adapter.top_k) == 3).any(axis=-1).all()
    # a second install replaces the state without wrapping twice; set_steer swaps steering in place
    swapped = moe_hook.swapped_modules(adapter, adapter.blocks()[0])
    originals = [type(m) for m in swapped]
    moe_hook.install(adapter, [])
    moe_hook.install(adapter, [])
    assert [type(m).__bases__ for m in swapped] == [(o,) for o in originals]
    ref = model(mx.array(SMALL))
    moe_hook.set_steer(adapter, bias)
    steered = model(mx.array(SMALL))
    moe_hook.set_steer(adapter, None)
    unsteered = model(mx.array(SMALL))
    moe_hook.remove(adapter)
    assert not np.array_equal(np.array(ref), np.array(steered))
    assert np.array_equal(np.array(ref), np.array(unsteered))


@pytest.mark.parametrize("bits", [None, 4], ids=["float", "4bit"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_expert_tensors_have_expert_axis(make_model, model_type, bits):
    model, config, adapter = _load(make_model, model_type, bits)
    block = adapter.blocks()[0]
    names = adapter.expert_tensors(block)
    params = dict(__import__("mlx.utils", fromlist=["tree_flatten"]).tree_flatten(block.parameters()))
    E = adapter.num_experts
    assert all(params[n].shape[0] == E for n in names)
    assert not any("shared" in n for n in names)
    router = adapter.router_attr
    assert any(n.startswith(f"{router}.") and n.endswith("weight") for n in names), names
    ins, out = expert_projections(adapter.experts(block))
    for proj in (*ins, out):
        assert any(n.startswith(f"{adapter.experts_attr}.") and n.endswith(f"{proj}.weight") for n in names), names
        if bits:
            assert any(n.startswith(f"{adapter.experts_attr}.") and n.endswith(f"{proj}.scales") for n in names)
    if model_type == "gpt_oss":
        assert f"{adapter.experts_attr}.down_proj.bias" in names and f"{router}.bias" in names


def test_moe_layer_rules(make_model):
    _, _, ad = _load(make_model, "glm4_moe", None, first_k_dense_replace=2, num_hidden_layers=4)
    assert ad.moe_layers() == [2, 3]
    _, _, ad = _load(make_model, "qwen3_moe", None, decoder_sparse_step=2, num_hidden_layers=4)
    assert ad.moe_layers() == [1, 3]
    _, _, ad = _load(make_model, "qwen3_moe", None, mlp_only_layers=[0], num_hidden_layers=3)
    assert ad.moe_layers() == [1, 2]
    _, cfg, ad = _load(make_model, "qwen3_5_moe", None)
    assert ad.config_keys() == [("text_config", "num_experts")] and ad.num_experts == 8


def test_a_dense_checkpoint_of_a_moe_family_is_a_one_line_error():
    """qwen3_5 and mistral3 configs are MoE or dense; a dense one is refused in one line, not a traceback."""
    from mlx_fun.testing.tiny import build_model, tiny_config

    cfg = tiny_config("qwen3_5", num_experts=0)
    with pytest.raises(UserError, match="this qwen3_5 model has no MoE layers"):
        get_adapter(build_model(cfg), cfg)


def test_doctor_names_moe_types_of_a_newer_mlx_lm(monkeypatch):
    """A type the installed mlx-lm ships but the registry lacks (as after an mlx-lm upgrade) is named by doctor."""
    from mlx_fun.jobs.doctor import model_types

    assert model_types() == f"{len(REGISTRY)} supported, 4 unsupported (see docs/guide/architectures.md)"
    monkeypatch.delitem(REGISTRY, "mellum")
    assert model_types().endswith("; MoE types of this mlx-lm that mlx-fun does not know yet: mellum")


def test_config_expert_facts_are_checked_once_before_loading(tmp_path):
    """io.check_config asks the family's adapter: top-k a whole number (hunyuan: or a list of equal ones) at most
    the routed-expert count; a dense checkpoint (0 experts) is left to the adapter's own no-MoE-layers message."""
    from mlx_fun.model.io import check_config
    from mlx_fun.testing.tiny import tiny_config

    where = tmp_path / "config.json"
    check_config(tiny_config("hunyuan", moe_topk=[2, 2]), where=where)
    check_config(tiny_config("qwen3_5", num_experts=0), where=where)
    for cfg, needle in [
        (tiny_config("hunyuan", moe_topk=[2, 3]), "per-layer moe_topk [2, 3] differ"),
        (tiny_config("hunyuan", moe_topk=[2, True]), "moe_topk (experts per token) must be a whole number"),
        (tiny_config("deepseek_v3", n_routed_experts=4, num_experts_per_tok=6), "num_experts_per_tok = 6 is more "
         "than the 4 routed experts (n_routed_experts)"),
        (tiny_config("mixtral", num_local_experts=-1), "num_local_experts (the routed-expert count) must be a whole"),
        (tiny_config("gpt_oss", num_experts_per_tok=0), "num_experts_per_tok (experts per token) must be a whole "
         "number of at least 1, got a number 0"),
    ]:
        with pytest.raises(UserError) as e:
            check_config(cfg, where=where)
        assert str(e.value).startswith(f"{where}: ") and needle in str(e.value), str(e.value)
