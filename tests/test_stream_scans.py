"""Issue 43: layer-streamed differential scans (``safety-scan`` / ``domain-scan --stream-layers``): both datasets
carried together through one streamed forward (each layer's weights read once), the in-memory report (counts
exactly, scores to float rounding)."""

from __future__ import annotations


import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_fun.adapters import get_adapter
from mlx_fun.errors import UserError, cli_names
from mlx_fun.model.io import load_model
from mlx_fun.observe.differential import report, scan, scan_streamed

from .conftest import FAMILIES

HARMFUL = [list(range(5, 21)), list(range(40, 56))]  # 2 samples × 16 tokens per dataset
BENIGN = [list(range(60, 76)), list(range(21, 37))]
KEYS = ("count", "weight_sum", "logit_sum")


def _reports(path, model_type):
    """The in-memory report of a fully loaded model and the streamed one of a lazily loaded copy."""
    model, _, config = load_model(path)
    adapter = get_adapter(model, config)
    lazy, _, lconfig = load_model(path, lazy=True)
    ladapter = get_adapter(lazy, lconfig)
    if ladapter.layerwise_blocker():
        with cli_names(), pytest.raises(UserError, match=f"which {model_type} does not allow: .*; run it without "
                                                         "--stream-layers"):
            scan_streamed(lazy, ladapter, [HARMFUL, BENIGN], batch_size=2)
        return None
    full = [scan(model, adapter, s, batch_size=2) for s in (HARMFUL, BENIGN)]
    streamed = scan_streamed(lazy, ladapter, [HARMFUL, BENIGN], batch_size=2)
    for i, layer in enumerate(ladapter.decoder_layers()[: ladapter.moe_layers()[-1] + 1]):  # every one released
        assert all(p.size == 0 for _, p in tree_flatten(layer.parameters())), i
    for a, b in zip(full, streamed):
        assert a.tokens == b.tokens == 32
        assert np.array_equal(a.count, b.count)
        for key in KEYS[1:]:
            np.testing.assert_allclose(getattr(b, key), getattr(a, key), rtol=1e-5, atol=1e-5, err_msg=key)
    return [report("safety", *taps, a, percentile=90.0, datasets={})
            for taps, a in ((full, adapter), (streamed, ladapter))]


def _assert_same_report(full: dict, streamed: dict) -> None:
    for key in full:
        if key in ("scores", "per_dataset"):
            continue
        want = pytest.approx(full[key], rel=1e-5, abs=1e-6) if key == "thresholds" else full[key]
        assert streamed[key] == want, key
    for k, v in full["scores"].items():
        np.testing.assert_allclose(streamed["scores"][k], v, rtol=1e-4, atol=2e-6, err_msg=k)
    for name, means in full["per_dataset"].items():
        for k, v in means.items():
            np.testing.assert_allclose(streamed["per_dataset"][name][k], v, rtol=1e-5, atol=2e-6, err_msg=k)


@pytest.mark.parametrize("bits", [None, 4], ids=["float", "q4"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_streamed_scan_equals_the_in_memory_scan(make_model, model_type, bits):
    kw = {"n_group": 1, "topk_group": 1} if model_type in ("deepseek_v3", "deepseek_v32") else {}
    reports = _reports(make_model(model_type, bits=bits, **kw), model_type)
    if reports is not None:  # else refused (deepseek_v41)
        _assert_same_report(*reports)


def test_a_family_that_cannot_stream_is_refused(make_model):
    assert _reports(make_model("deepseek_v41"), "deepseek_v41") is None
