"""Issue 43: a layer-streamed collect (``collect --stream-layers``): one decoder layer's weights in memory at a
time, the in-memory collect's statistics (counts exactly, sums to float rounding), every family; a killed run
resumes at the next layer and writes what an uninterrupted run writes."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_fun.adapters import get_adapter
from mlx_fun.errors import UserError, cli_names
from mlx_fun.model.io import load_model
from mlx_fun.observe.collect import collect, collect_streamed
from mlx_fun.observe.saliency import ARRAY_KEYS

from .conftest import FAMILIES

SAMPLES = [list(range(5, 21)), list(range(40, 52))]  # 2 samples of 16 and 12 tokens: one padded batch


def _pair(path, model_type):
    """The in-memory statistics of a fully loaded model and the streamed ones of a lazily loaded copy."""
    model, _, config = load_model(path)
    adapter = get_adapter(model, config)
    lazy, _, lconfig = load_model(path, lazy=True)
    ladapter = get_adapter(lazy, lconfig)
    if ladapter.layerwise_blocker():
        with cli_names(), pytest.raises(UserError, match=f"which {model_type} does not allow: .*without "
                                                         "--stream-layers.*--pipeline under mlx.launch"):
            collect_streamed(lazy, ladapter, SAMPLES, batch_size=2)
        return None, None, None
    full = collect(model, adapter, SAMPLES, batch_size=2)
    streamed = collect_streamed(lazy, ladapter, SAMPLES, batch_size=2)
    return full, streamed, ladapter


@pytest.mark.parametrize("bits", [None, 4], ids=["float", "q4"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_streamed_collect_equals_the_in_memory_collect(make_model, model_type, bits):
    kw = {"n_group": 1, "topk_group": 1} if model_type in ("deepseek_v3", "deepseek_v32") else {}
    full, streamed, adapter = _pair(make_model(model_type, bits=bits, **kw), model_type)
    if full is None:
        return
    assert streamed.total_tokens == full.total_tokens == 28
    assert np.array_equal(streamed.freq, full.freq)
    assert np.array_equal(streamed.reap_count, full.reap_count)
    for key in ARRAY_KEYS:
        np.testing.assert_allclose(getattr(streamed, key), getattr(full, key), rtol=1e-5, atol=1e-6, err_msg=key)
    # every visited layer was released: nothing of its weights is left
    from mlx.utils import tree_flatten

    for i, layer in enumerate(adapter.decoder_layers()[: adapter.moe_layers()[-1] + 1]):
        assert all(a.size == 0 for _, a in tree_flatten(layer.parameters())), i
