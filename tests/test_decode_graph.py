"""The hooked call's compiled graph for small calls (decode): the same outputs and taps as the plain call, for
every family, float and 4-bit, steered or not; a family whose routing cannot be traced keeps the plain call."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_fun.core import classswap
from mlx_fun.model import moe_hook
from mlx_fun.adapters.steer import RouteSteer

from .conftest import FAMILIES
from .test_adapters import _load

DECODE = [[5], [250]]  # two sequences, one token each: a batched decode step
PROMPT = [[5, 17, 99, 3, 250]]


def _run(model, adapter, tokens, steer=None):
    seen = []
    tap = lambda layer, i, w, lg, y: seen.append((layer, np.array(i), np.array(w), np.array(lg), np.array(y)))  # noqa
    moe_hook.install(adapter, [tap], steer)
    try:
        out = np.array(model(mx.array(tokens)))
    finally:
        states = [classswap.get_state(b, "_mlxfun_hook") for b in adapter.blocks()]
        compiled = [bool(s.graphs) and s.compile for s in states]
        moe_hook.remove(adapter)
    return out, seen, compiled


@pytest.mark.parametrize("bits", [None, 4], ids=["float", "4bit"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_compiled_small_calls_equal_the_plain_call(make_model, model_type, bits, monkeypatch):
    model, config, adapter = _load(make_model, model_type, bits)
    E = adapter.num_experts
    steer = {pos: RouteSteer.build(scheme, E, [3], [1], -1e9, 1e4)
             for pos, scheme in zip(range(len(adapter.moe_layers())), ["additive", "rank"] * 99)}
    for tokens in (DECODE, PROMPT):
        for st in (None, steer):
            out, seen, compiled = _run(model, adapter, tokens, st)
            with monkeypatch.context() as m:
                m.setattr(moe_hook, "COMPILE_MAX_TOKENS", 0)
                ref, ref_seen, plain = _run(model, adapter, tokens, st)
            assert not any(plain)
            if not adapter.split_router and moe_hook.graph_backend():
                assert all(compiled), f"{model_type}: a block fell back to the plain call"
            assert np.array_equal(out, ref)
            assert len(seen) == len(ref_seen) == len(adapter.moe_layers())
            for got, want in zip(seen, ref_seen):
                assert got[0] == want[0]
                for a, b in zip(got[1:], want[1:]):
                    assert np.array_equal(a, b)


def test_the_graph_reads_the_weights_of_each_call_and_retraces_after_a_swap(make_model):
    from mlx_fun.dispatch import experts as dispatch

    if not moe_hook.graph_backend():
        pytest.skip("the compiled graph runs on the CPU only (moe_hook.graph_backend)")

    model, config, adapter = _load(make_model, "qwen3_moe", None)
    moe_hook.install(adapter)
    try:
        before = np.array(model(mx.array(DECODE)))
        experts = adapter.experts(adapter.blocks()[0])
        experts.down_proj.weight = experts.down_proj.weight * 2  # a rewrite after the first trace
        after = np.array(model(mx.array(DECODE)))
        state = classswap.get_state(adapter.blocks()[0], "_mlxfun_hook")
        traced = set(state.graphs)
        dispatch.install(model, force="sorted")  # a class swap: the graph is traced again, with the new call
        swapped = np.array(model(mx.array(DECODE)))
        assert set(state.graphs).isdisjoint(traced) and state.graphs
        moe_hook.COMPILE_MAX_TOKENS, saved = 0, moe_hook.COMPILE_MAX_TOKENS
        try:
            plain = np.array(model(mx.array(DECODE)))
        finally:
            moe_hook.COMPILE_MAX_TOKENS = saved
    finally:
        moe_hook.remove(adapter)
        dispatch.remove(model)
    assert not np.array_equal(before, after)
    assert np.array_equal(after, np.array(model(mx.array(DECODE))))
    np.testing.assert_allclose(swapped, plain, rtol=0, atol=0)


def test_routing_that_reads_back_on_the_host_keeps_the_plain_call(make_model):
    if not moe_hook.graph_backend():
        pytest.skip("the compiled graph runs on the CPU only (moe_hook.graph_backend)")
    model, config, adapter = _load(make_model, "qwen3_moe", None)
    ref = np.array(model(mx.array(DECODE)))
    route = adapter.route

    def host_route(block, x, steer=None):
        inds, weights, logits = route(block, x, steer)
        assert inds.max().item() < adapter.num_experts  # a host read: cannot be traced
        return inds, weights, logits

    adapter.route = host_route
    with moe_hook.hooked(adapter):
        out = np.array(model(mx.array(DECODE)))
        states = [classswap.get_state(b, "_mlxfun_hook") for b in adapter.blocks()]
        assert not any(s.compile for s in states) and not any(s.graphs for s in states)
        again = np.array(model(mx.array(DECODE)))
    assert np.array_equal(out, ref) and np.array_equal(again, ref)
