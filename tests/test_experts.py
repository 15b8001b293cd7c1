"""The experts of every family equal their plain-MLX oracle (tests/oracles.py: one per expert type)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_fun.adapters import get_adapter
from mlx_fun.adapters.base import EXPERT_TYPES
from mlx_fun.model.io import load_model

from .conftest import FAMILIES
from .oracles import gemm2_bias_swiglu_clamp, interleave_gate_up, reference_expert_outputs


@pytest.mark.parametrize("bits", [None, 4], ids=["float", "4bit"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_experts_equal_reference(make_model, model_type, bits):
    model, _, config = load_model(make_model(model_type, bits=bits))
    adapter = get_adapter(model, config)
    block = adapter.blocks()[0]
    experts = adapter.experts(block)
    D = adapter.hidden_size
    scale = 4.0 if adapter.expert_type == "swiglu_oai" else 1.0  # push gpt-oss pre-activations past the clamp
    x = mx.random.normal((12, D), key=mx.random.key(1)) * scale
    inds, weights, _ = adapter.route(block, x)
    x = adapter.expert_input(block, x, inds, weights)  # latent projection (nemotron_h), weight-scaled (llama4)
    y = experts(x, inds)
    ref = reference_expert_outputs(experts, x, inds, adapter.expert_type, **adapter.expert_params(block))
    tol = 1e-4 if bits is None else 2e-3
    np.testing.assert_allclose(np.array(y), np.array(ref), rtol=tol, atol=tol)
    assert adapter.expert_type in EXPERT_TYPES


def test_gpt_oss_clamp_is_exercised(make_model):
    """The inputs used above really hit both clamps (|linear| > 7 and gate > 7), so the oracle checks them."""
    model, _, config = load_model(make_model("gpt_oss"))
    adapter = get_adapter(model, config)
    experts = adapter.experts(adapter.blocks()[0])
    x = mx.random.normal((12, 64), key=mx.random.key(1)) * 4.0
    up = x @ experts.up_proj.weight[0].T + experts.up_proj.bias[0]
    gate = x @ experts.gate_proj.weight[0].T + experts.gate_proj.bias[0]
    assert mx.abs(up).max().item() > 7 and gate.max().item() > 7


def test_gemm2_oracle_by_hand():
    """The oracle itself on a 1-token, 1-neuron case computed by hand."""
    x = mx.array([[1.0, 2.0]])
    w_up, w_gate = mx.array([[3.0, 4.0]]), mx.array([[0.5, 0.0]])  # up·x = 11 → clamp 7; gate·x = 0.5
    fused = interleave_gate_up(w_up, w_gate)
    out = gemm2_bias_swiglu_clamp(x, fused, mx.array([0.0, 0.0]), mx.array([[2.0, -1.0]]), mx.array([0.1, 0.2]))
    g = 0.5 * (1 / (1 + np.exp(-1.702 * 0.5)))
    np.testing.assert_allclose(np.array(out), [[8 * g * 2 + 0.1, -8 * g + 0.2]], rtol=1e-6)
