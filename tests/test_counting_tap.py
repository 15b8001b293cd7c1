"""Issue 31: one counting tap. collect's SaliencyTap hands a forward over as one Forward record (serve queues them);
collect.accumulate counts queued records exactly as flushing each forward at once does, padding and trimmed
positions left out; update_layers counts a subset of the layers as update does layer by layer."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_fun.model import moe_hook
from mlx_fun.adapters import get_adapter
from mlx_fun.observe.collect import SaliencyTap, accumulate
from mlx_fun.model.io import load_model
from mlx_fun.observe.saliency import ARRAY_KEYS, SaliencyAccumulator


def test_queued_records_count_like_flushing_each_forward(make_model):
    model, _, config = load_model(make_model("qwen3_moe"))
    adapter = get_adapter(model, config)
    batches = [mx.array([[5, 9, 11, 40, 2], [7, 7, 3, 0, 0]]), mx.array([[19, 23, 4]])]
    valids = [np.array([[True] * 5, [True] * 3 + [False] * 2]), None]
    flushed, queued = SaliencyAccumulator.for_adapter(adapter), SaliencyAccumulator.for_adapter(adapter)
    tap, records = SaliencyTap(norms=True), []
    with moe_hook.hooked(adapter, [tap]):
        for x, valid in zip(batches, valids):
            model(x)
            assert tap.flush(flushed, valid) == (8 if valid is not None else 3)
            model(x)
            records.append(tap.take(valid))
    assert tap.take() is None  # taken: the tap starts afresh
    assert [r.positions for r in records] == [10, 3] and records[0].layers == list(range(len(adapter.moe_layers())))
    assert accumulate(queued, records) == 11
    np.testing.assert_array_equal(queued.freq, flushed.freq)
    for key in ARRAY_KEYS:
        np.testing.assert_allclose(getattr(queued, key), getattr(flushed, key), rtol=1e-12, err_msg=key)
    assert queued.freq.sum() == 11 * adapter.top_k * len(adapter.moe_layers())


def test_update_layers_of_a_subset_is_update_layer_by_layer():
    rng = np.random.default_rng(0)
    inds = rng.integers(0, 6, size=(2, 7, 2))
    w, n = rng.random((2, 7, 2)), rng.random((2, 7, 2))
    a, b = SaliencyAccumulator(4, 6, top_k=2), SaliencyAccumulator(4, 6, top_k=2)
    a.update_layers(inds, w, n, layers=[3, 1])
    b.update(3, inds[0], w[0], n[0])
    b.update(1, inds[1], w[1], n[1])
    for key in ARRAY_KEYS:
        np.testing.assert_allclose(getattr(a, key), getattr(b, key), rtol=1e-12, err_msg=key)
    assert a.freq[[0, 2]].sum() == 0 and a.freq[3].sum() == a.freq[1].sum() == 14
