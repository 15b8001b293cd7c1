"""Saliency accumulators: hand-checked numbers, .npz round trip, mismatch errors, collect on real tiny models."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_fun.model import moe_hook
from mlx_fun.adapters import get_adapter
from mlx_fun.observe.collect import SaliencyTap, collect
from mlx_fun.errors import UserError
from mlx_fun.model.io import load_model
from mlx_fun.observe.saliency import ARRAY_KEYS, SaliencyAccumulator

from .conftest import FAMILIES


def test_reap_matches_hand_computation():
    acc = SaliencyAccumulator(1, 4, model_type="qwen3_moe", top_k=2)
    # 3 tokens, top-2: (experts, weights, norms)
    inds = np.array([[0, 2], [2, 3], [0, 2]])
    w = np.array([[0.75, 0.25], [0.5, 0.5], [0.25, 0.75]])
    n = np.array([[2.0, 4.0], [1.0, 3.0], [6.0, 2.0]])
    acc.update(0, inds, w, n)
    # expert 0: tokens 0 and 2: ‖y‖·w = 2·0.75, 6·0.25 → mean (1.5 + 1.5) / 2 = 1.5
    # expert 2: 4·0.25, 1·0.5, 2·0.75 → (1 + 0.5 + 1.5) / 3 = 1.0
    # expert 3: 3·0.5 = 1.5; expert 1: never routed → 0
    np.testing.assert_allclose(acc.scores("reap")[0], [1.5, 0.0, 1.0, 1.5])
    np.testing.assert_allclose(acc.scores("ean")[0], [4.0, 0.0, 7.0 / 3.0, 3.0])
    np.testing.assert_allclose(acc.scores("freq")[0], [2, 0, 3, 1])
    np.testing.assert_allclose(acc.scores("weighted_freq")[0], [1.0, 0.0, 1.5, 0.5])
    np.testing.assert_allclose(acc.max_activation_norm[0], [6.0, 0.0, 4.0, 3.0])
    assert acc.freq.dtype == np.float64
    with pytest.raises(UserError, match="unknown metric"):
        acc.scores("bogus")


def test_frequency_only_update_leaves_reap_zero():
    acc = SaliencyAccumulator(2, 4)
    acc.update(1, np.array([[1, 3]]), np.array([[0.6, 0.4]]))
    assert acc.freq[1].tolist() == [0, 1, 0, 1] and acc.reap_count.sum() == 0 and not acc.has_norms
    assert acc.scores("reap").sum() == 0


def test_npz_round_trip_and_mismatch(tmp_path, make_model):
    acc = SaliencyAccumulator(2, 8, model_type="qwen3_moe", moe_layer_indices=[0, 1], top_k=2)
    rng = np.random.default_rng(0)
    acc.update(0, rng.integers(0, 8, (50, 2)), rng.random((50, 2)), rng.random((50, 2)))
    acc.update(1, rng.integers(0, 8, (50, 2)), rng.random((50, 2)), rng.random((50, 2)))
    acc.total_tokens = 50
    path = acc.save(tmp_path / "s.npz")
    assert path.exists() and not list(tmp_path.glob(".*tmp*"))
    data = np.load(path)
    for key in (*ARRAY_KEYS, "model_type", "num_layers", "num_experts", "moe_layer_indices"):
        assert key in data
    back = SaliencyAccumulator.load(path)
    for key in ARRAY_KEYS:
        np.testing.assert_array_equal(getattr(back, key), getattr(acc, key))
    assert (back.model_type, back.moe_layer_indices, back.top_k, back.total_tokens) == ("qwen3_moe", [0, 1], 2, 50)

    model, _, config = load_model(make_model("glm4_moe"))  # MoE layers [1, 2], 8 experts
    with pytest.raises(UserError, match="does not match the model: model_type is qwen3_moe in the file but glm4_moe"):
        back.check_matches(get_adapter(model, config))
    back.model_type = "glm4_moe"
    with pytest.raises(UserError, match="does not match the model: moe_layer_indices is \\[0, 1\\] in the file but \\[1, 2\\]"):
        back.check_matches(get_adapter(model, config))
    back.model_type = "qwen3_moe"
    model, _, config = load_model(make_model("qwen3_moe", num_experts=16))
    with pytest.raises(UserError, match="num_experts is 8 in the file but 16"):
        back.check_matches(get_adapter(model, config))

    with pytest.raises(UserError, match="does not exist"):
        SaliencyAccumulator.load(tmp_path / "missing.npz")
    (tmp_path / "junk.npz").write_text("not a zip")
    with pytest.raises(UserError, match="not a readable .npz"):
        SaliencyAccumulator.load(tmp_path / "junk.npz")
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(UserError, match="no 'freq' array"):
        SaliencyAccumulator.load(tmp_path / "other.npz")


def test_add_sums_and_checks_compatibility():
    a = SaliencyAccumulator(1, 4, model_type="m")
    b = SaliencyAccumulator(1, 4, model_type="m")
    a.update(0, np.array([[0, 1]]), np.ones((1, 2)), np.array([[1.0, 5.0]]))
    b.update(0, np.array([[1, 2]]), np.ones((1, 2)), np.array([[2.0, 3.0]]))
    a.add(b)
    assert a.freq[0].tolist() == [1, 2, 1, 0]
    assert a.max_activation_norm[0].tolist() == [1.0, 5.0, 3.0, 0.0]
    with pytest.raises(UserError, match="num_experts"):
        a.add(SaliencyAccumulator(1, 5, model_type="m"))


@pytest.mark.parametrize("bits", [None, 4], ids=["float", "4bit"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_collect_counts_every_token(make_model, model_type, bits):
    """Per layer, Σ freq = tokens × top_k, and REAP equals a direct computation from the hooked call."""
    model, _, config = load_model(make_model(model_type, bits=bits))
    adapter = get_adapter(model, config)
    samples = [list(range(3, 40)), list(range(100, 112)), list(range(200, 229))]
    n_tokens = sum(map(len, samples))
    acc = collect(model, adapter, samples, batch_size=2)
    assert acc.total_tokens == n_tokens
    np.testing.assert_array_equal(acc.freq.sum(axis=1), n_tokens * adapter.top_k)
    assert (acc.weighted_freq_sum >= 0).all() and acc.weighted_freq_sum.sum() > 0
    assert acc.reap_count.sum() == acc.freq.sum()

    # reference: one sample at a time, recording (inds, weights, y) and reducing by hand
    ref = np.zeros_like(acc.reap_sum)
    rec = []
    with moe_hook.hooked(adapter, [lambda layer, i, w, lg, y: rec.append((layer, i, w, y))]):
        for s in samples:
            mx.eval(model(mx.array([s])))
    for layer, i, w, y in rec:
        i = np.array(i).reshape(-1, adapter.top_k)
        w = np.array(w, dtype=np.float64).reshape(-1, adapter.top_k)
        norms = np.sqrt((np.array(y, dtype=np.float64) ** 2).sum(-1)).reshape(-1, adapter.top_k)
        for t in range(len(i)):
            for j in range(adapter.top_k):
                ref[layer, i[t, j]] += norms[t, j] * w[t, j]
    np.testing.assert_allclose(acc.reap_sum, ref, rtol=2e-4, atol=1e-5)


def test_batching_excludes_padding(make_model):
    model, _, config = load_model(make_model("qwen3_moe"))
    adapter = get_adapter(model, config)
    samples = [list(range(3, 40)), list(range(100, 105)), list(range(200, 221))]
    one = collect(model, adapter, samples, batch_size=1)
    three = collect(model, adapter, samples, batch_size=3)
    np.testing.assert_array_equal(one.freq, three.freq)
    np.testing.assert_allclose(one.reap_sum, three.reap_sum, rtol=1e-4)


def test_lightweight_tap_records_no_norms(make_model):
    model, _, config = load_model(make_model("mixtral"))
    adapter = get_adapter(model, config)
    acc = SaliencyAccumulator.for_adapter(adapter)
    tap = SaliencyTap(norms=False)
    with moe_hook.hooked(adapter, [tap]):
        model(mx.array([[1, 2, 3, 4]]))
    tap.flush(acc)
    assert acc.freq.sum() == 4 * adapter.top_k * len(adapter.moe_layers()) and acc.reap_count.sum() == 0
