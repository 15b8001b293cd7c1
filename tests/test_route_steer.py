"""Steering inside each family's own routing (``route(block, x, steer)``), checked against a plain NumPy
re-implementation of "steer the logits (and a selection-only score), then the family's selection" — never against
the adapter itself — for every family, both schemes; and the guarantees: a masked expert is never chosen and a
boosted one always is, whatever the correction bias; the rank scheme boosts at most top_k and keeps weights sane.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlx_fun.adapters.steer import RouteSteer
from mlx_fun.experts.steering import Steering, SteeringError, from_reports

from .conftest import FAMILIES
from .test_adapters import LARGE, _load, _record_blocks

SELECTION_BIASES = ("e_score_correction_bias", "expert_bias", "router_bias")
NEG_INF_FILL = {"bailing_moe_v3", "bailing_hybrid"}  # dropped groups at -inf (the others write 0.0)


def _selection_bias(block):
    """The block's selection-only bias (name, array), found by name; None for routers without one."""
    for name, value in tree_flatten(block.parameters()):
        if name.split(".")[-1] in SELECTION_BIASES and value.ndim == 1:
            return name, value
    return None


def _gate_attr(block, name, default):
    for owner in (block, getattr(block, "gate", None), getattr(block, "args", None)):
        if owner is not None and getattr(owner, name, None) is not None:
            return getattr(owner, name)
    return default


def _act(block, t):
    kind = _gate_attr(block, "score_func", None) or _gate_attr(block, "score_function", None) or "sigmoid"
    if kind == "softmax":
        e = np.exp(t - t.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    if kind == "sqrtsoftplus":
        return np.sqrt(np.logaddexp(0, t))
    return 0.5 * (1 + np.tanh(t / 2))  # the sigmoid, without overflow


def _np_steer(t, scheme, on, off, mask, boost, floor=None):
    """The steering rule, written out: add the values, or move boosted to max + 0.01 and masked to min - 0.01."""
    t = t.copy()
    if scheme == "additive":
        t[..., off] += mask
        t[..., on] += boost
        return t
    hi, lo = t.max(-1, keepdims=True), t.min(-1, keepdims=True)
    if floor is not None:
        lo = np.minimum(lo, floor)
    t[..., on] = np.broadcast_to(hi + 0.01, t[..., on].shape)
    t[..., off] = np.broadcast_to(lo - 0.01, t[..., off].shape)
    return t


def _reference_scores(family, adapter, block, logits, scheme, on, off, mask, boost):
    """Per token, the scores the family's top-k is taken over once the steered logits (and, with a selection-only
    bias, the steered selection score) went through its group limit: a plain re-implementation."""
    t = np.array(logits, dtype=np.float64)
    t = t / float(_gate_attr(block, "gate_temp", 1.0))
    t = _np_steer(t, scheme, on, off, mask, boost)
    softcap = float(_gate_attr(block, "softcap", 0.0) or 0.0)
    if softcap > 0:
        t = np.tanh(t / softcap) * softcap
    bias = _selection_bias(block)
    if bias is None:
        s = t  # every activation these routers use is increasing: their top-k is the logits' top-k
    else:
        s = _np_steer(_act(block, t) + np.array(bias[1], dtype=np.float64), scheme, on, off, mask, boost, floor=0.0)
    if adapter.groups:
        n_group, topk_group = adapter.groups
        g = s.reshape(*s.shape[:-1], n_group, -1)
        group_scores = np.sort(g, axis=-1)[..., -2:].sum(-1)
        dropped = np.argsort(group_scores, axis=-1)[..., : n_group - topk_group]
        fill = -np.inf if family in NEG_INF_FILL else 0.0
        np.put_along_axis(g, dropped[..., None], fill, axis=-2)
        s = g.reshape(s.shape)
    return s


def _assert_valid_top_k(inds, ref, k, tol=1e-4):
    """``inds`` (T, k) is a top-k of ``ref`` (T, E) up to near-ties: nothing left out beats anything chosen."""
    inds, ref = np.array(inds).reshape(-1, k), ref.reshape(-1, ref.shape[-1])
    for t in range(len(ref)):
        chosen = np.zeros(ref.shape[-1], bool)
        chosen[inds[t]] = True
        assert chosen.sum() == k
        assert ref[t, chosen].min() >= ref[t, ~chosen].max() - tol, (t, sorted(inds[t]), np.argsort(-ref[t])[:k])


def _blocks(make_model, family, **overrides):
    model, config, adapter = _load(make_model, family, None, **overrides)
    records = _record_blocks(model, adapter, LARGE)
    return adapter, [(adapter.blocks()[pos], rec[0]) for pos, rec in enumerate(records[:2])]


@pytest.mark.parametrize("family", FAMILIES)
def test_steering_is_the_family_selection_on_steered_logits(make_model, family):
    adapter, blocks = _blocks(make_model, family)
    E, k = adapter.num_experts, adapter.top_k
    rng = np.random.default_rng(1)
    for block, x in blocks:
        _, _, logits = adapter.route(block, x)
        off = sorted(rng.choice(E, size=3, replace=False).tolist())
        on = [int(rng.choice([e for e in range(E) if e not in off]))]
        for scheme, mask, boost in (("additive", -0.5, 0.7), ("additive", -1e9, 1e4), ("rank", -1e9, 1e4)):
            steer = RouteSteer.build(scheme, E, on, off, mask, boost)
            inds, weights, raw = adapter.route(block, x, steer)
            assert np.array_equal(np.array(raw), np.array(logits))  # logits returned stay the raw router's
            ref = _reference_scores(family, adapter, block, logits, scheme, on, off, mask, boost)
            if not (adapter.groups and scheme == "additive" and mask < -1):
                # (a group's top-2 sum holding a -1e9 mask is only known to float32's 64 there: ties either way)
                _assert_valid_top_k(inds, ref, k)
            chosen = np.array(inds).reshape(-1, k)
            if mask < -1:  # forced: never a masked expert; the boosted one always (when no group limit intervenes)
                assert not np.isin(chosen, off).any()
                if scheme == "additive" or not adapter.groups:
                    assert (chosen == on[0]).any(axis=-1).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_no_correction_bias_undoes_a_mask_or_a_boost(make_model, family):
    """A masked expert with the largest selection-only bias is never chosen, a boosted one with the smallest
    always is — the bias is applied to the selection score itself, not only to the logits."""
    adapter, blocks = _blocks(make_model, family)
    E, k = adapter.num_experts, adapter.top_k
    for block, x in blocks:
        found = _selection_bias(block)
        if found is None:
            continue
        name, bias = found
        last = E - 1  # in another group than expert 0 where the router is group-limited
        block.update(tree_unflatten([(name, bias.at[0].add(50.0).at[last].add(-50.0))]))
        plain, _, _ = adapter.route(block, x)
        assert (np.array(plain) == 0).any(axis=-1).all()  # unsteered, expert 0's bias wins every token
        assert not (np.array(plain) == last).any()
        for scheme in ("additive", "rank"):
            inds, _, _ = adapter.route(block, x, RouteSteer.build(scheme, E, [last], [0], -1e9, 1e4))
            chosen = np.array(inds).reshape(-1, k)
            assert not (chosen == 0).any(), scheme
            if scheme == "additive" or not adapter.groups:
                assert (chosen == last).any(axis=-1).all(), scheme


def test_rank_keeps_a_boosted_experts_weight_near_the_favourites(make_model):
    """On a softmax router the additive boost takes (almost) all the weight; rank gives about the favourite's."""
    adapter, blocks = _blocks(make_model, "qwen3_moe")
    block, x = blocks[0]
    E, k = adapter.num_experts, adapter.top_k
    plain_inds, plain_w, _ = adapter.route(block, x)
    top = np.array(plain_w).reshape(-1, k).max(-1)
    for scheme in ("additive", "rank"):
        inds, w, _ = adapter.route(block, x, RouteSteer.build(scheme, E, [5], [], -1e9, 1e4))
        inds, w = np.array(inds).reshape(-1, k), np.array(w).reshape(-1, k)
        boosted = w[inds == 5]
        assert len(boosted) == len(inds)
        if scheme == "additive":
            assert boosted.min() > 0.99
        else:
            assert np.all(boosted <= np.maximum(top, 0.5) * np.exp(0.011) + 1e-6)  # renormalised over k = 2
            assert np.all(boosted < 0.9)


def test_rank_scheme_boosts_at_most_top_k(tmp_path):
    with pytest.raises(SteeringError, match=r"activate\.1|at most top_k = 2") as e:
        from_reports(moe_layer_indices=[1], num_experts=8, top_k=2, activate={"1": [0, 1, 2]})  # rank, the default
    assert e.value.field == "activate.1"
    s = from_reports(moe_layer_indices=[1], num_experts=8, top_k=2, activate={"1": [0, 1, 2]}, scheme="additive")
    assert s.warnings and s.scheme == "additive"  # additive: warns
    with pytest.raises(SteeringError, match="scheme must be one of additive, rank") as e:
        from_reports(moe_layer_indices=[1], num_experts=8, top_k=2, activate={"1": [0]}, scheme="ranked")
    assert e.value.field == "scheme"


@pytest.mark.parametrize("family, overrides", [("qwen3_moe", {}), ("deepseek_v3", {}),
                                              ("deepseek_v3", {"topk_group": 1}), ("gpt_oss", {}), ("mixtral", {})],
                         ids=["qwen3_moe", "deepseek_v3", "deepseek_v3-one-group", "gpt_oss", "mixtral"])
def test_rank_selects_every_boosted_expert_up_to_top_k(make_model, family, overrides):
    """Rank boosting k experts side by side: every token picks exactly them, on group-limited routers too (the k
    experts fill ceil(k / group size) groups, never more than topk_group in a valid config; one-group included)."""
    adapter, blocks = _blocks(make_model, family, **overrides)
    E, k = adapter.num_experts, adapter.top_k
    on = list(range(E - k, E))
    if adapter.groups:
        n_group, topk_group = adapter.groups
        assert len({e // (E // n_group) for e in on}) <= (topk_group or n_group)
    for block, x in blocks:
        inds, _, _ = adapter.route(block, x, RouteSteer.build("rank", E, on, [], -1e9, 1e4))
        chosen = np.sort(np.array(inds).reshape(-1, k), axis=-1)
        assert (chosen == on).all()


@pytest.mark.parametrize("bits", [None, 4], ids=["float", "4bit"])
@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "minimax"])
def test_empty_steering_routes_bit_identically(make_model, family, bits):
    from mlx_fun.model import moe_hook

    model, config, adapter = _load(make_model, family, bits)
    assert Steering().route_steers(adapter) == {}
    ids = mx.array(LARGE)
    ref = model(ids)
    for scheme in ("additive", "rank"):
        steers = {pos: RouteSteer.build(scheme, adapter.num_experts, [], [], -1e9, 1e4)
                  for pos in range(len(adapter.moe_layers()))}
        with moe_hook.hooked(adapter, [], steers):
            out = model(ids)
        assert np.array_equal(np.array(ref), np.array(out)), scheme
