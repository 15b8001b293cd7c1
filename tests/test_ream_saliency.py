"""Issue 45: merge's default saliency is REAM's own (SamsungSAILMontreal/ream): per layer, during the merge, on the
hidden states of the already merged layers, the per-batch mean over routed tokens of p² ‖y‖ (p: the full softmax,
not renormalised), averaged over the batches. Pinned against a numpy hand computation on a tiny float model, and
the second layer's saliency and centroids shown to follow from the first layer's merge."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_fun.adapters import get_adapter
from mlx_fun.datasets.calibration import Calibration
from mlx_fun.errors import UserError
from mlx_fun.experts.selection import Selection
from mlx_fun.model import moe_hook
from mlx_fun.rewrite.merge import merge_model
from mlx_fun.rewrite.merge_options import Ream
from mlx_fun.testing.tiny import build_model, tiny_config

RNG = np.random.default_rng(11)
SAMPLES = [RNG.integers(3, 500, 12).tolist() for _ in range(5)]  # one length: no padding, 3 saliency batches of 2
BATCH, N_PRUNE = 2, 3


class _Inputs:
    """A tap keeping every MoE block's input (``{position: [per call]}``)."""

    def __init__(self):
        self.x: dict[int, list] = {}

    def on_input(self, layer, h):
        self.x.setdefault(layer, []).append(h)

    def __call__(self, layer, inds, weights, logits, y):
        pass


def _moe_inputs(model, cfg) -> dict[int, np.ndarray]:
    """(samples, T, D) input of every MoE block of ``model`` on SAMPLES."""
    tap = _Inputs()
    with moe_hook.hooked(get_adapter(model, cfg), [tap]):
        for s in SAMPLES:
            mx.eval(model(mx.array([s])))
    return {pos: np.concatenate([np.array(h.astype(mx.float32)).reshape(1, -1, h.shape[-1]) for h in hs])
            for pos, hs in tap.x.items()}


def _hand_saliency(block, x: np.ndarray, top_k: int) -> np.ndarray:
    """REAM's reference arithmetic in numpy: softmax router, top-k by probability, SwiGLU experts, per batch of
    BATCH samples the mean over routed tokens of p · ‖p · y‖, summed over batches / their number; zeros lifted."""
    W = np.array(block.gate.weight, dtype=np.float64)
    ex = block.switch_mlp
    g, u, d = (np.array(getattr(ex, n).weight, dtype=np.float64) for n in ("gate_proj", "up_proj", "down_proj"))
    E, n_batches = W.shape[0], -(-len(x) // BATCH)
    total = np.zeros(E)
    for b0 in range(0, len(x), BATCH):
        t = x[b0:b0 + BATCH].reshape(-1, x.shape[-1]).astype(np.float64)
        logits = t @ W.T
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        routed = np.argsort(-p, axis=-1)[:, :top_k]
        for e in range(E):
            hit = (routed == e).any(-1)
            if not hit.any():
                continue
            a = t[hit] @ g[e].T
            y = (a / (1 + np.exp(-a)) * (t[hit] @ u[e].T)) @ d[e].T
            gated = p[hit, e, None] * y
            total[e] += np.mean(p[hit, e] * np.linalg.norm(gated, axis=-1))
    s = total / n_batches
    s[s == 0] = min(0.5, s[s > 0].min())
    return s


def _top(saliency, kept: int) -> list[int]:
    return sorted(np.argsort(-np.asarray(saliency), kind="stable")[:kept].tolist())


@pytest.fixture(scope="module")
def merged():
    """``(cfg, the original model, the layerwise-merged model, its metadata)`` of a 2-layer float qwen3_moe."""
    cfg = tiny_config("qwen3_moe")
    model = build_model(cfg)
    meta = merge_model(model, get_adapter(model, cfg), SAMPLES, selection=Selection(n_prune=N_PRUNE),
                       ream=Ream(max_similarity_tokens=24, max_alignment_tokens=16),
                       calibration=Calibration(seed=0, batch_size=BATCH))
    return cfg, build_model(cfg), model, meta


def test_layerwise_saliency_is_the_references_p_squared_norm(merged):
    cfg, original, _model, meta = merged
    assert meta["saliency_source"] == "layerwise" and meta["metric"].startswith("ream layerwise")
    x = _moe_inputs(original, cfg)
    want = _hand_saliency(original.layers[0].mlp, x[0], cfg["num_experts_per_tok"])
    np.testing.assert_allclose(meta["saliency"]["0"], want, rtol=2e-4)
    assert meta["centroid_map"]["0"] == _top(want, 8 - N_PRUNE)  # the E − n_prune most salient


def test_second_layer_saliency_follows_the_first_layers_merge(merged):
    """Layer 1 is scored on the hidden states of the merged layer 0: its recorded saliency is the hand computation
    on (merged layer 0, original layer 1), not on the original model, and so are its centroids."""
    cfg, original, model, meta = merged
    before = _hand_saliency(original.layers[1].mlp, _moe_inputs(original, cfg)[1], cfg["num_experts_per_tok"])
    hybrid = build_model(cfg)
    hybrid.model.layers[0] = model.model.layers[0]  # merged layer 0 (5 experts), original layer 1
    after = _hand_saliency(hybrid.layers[1].mlp, _moe_inputs(hybrid, cfg)[1], cfg["num_experts_per_tok"])
    np.testing.assert_allclose(meta["saliency"]["1"], after, rtol=2e-4)
    assert np.abs(after - before).max() > 0.05 * before.max()
    assert meta["centroid_map"]["1"] == _top(after, 5) != _top(before, 5)


def test_a_saliency_array_needs_the_file_source():
    cfg = tiny_config("qwen3_moe")
    model = build_model(cfg)
    with pytest.raises(UserError, match=r"^a saliency file is read only with saliency_source= file; "):
        merge_model(model, get_adapter(model, cfg), SAMPLES, saliency=np.ones((2, 8)),
                    selection=Selection(n_prune=N_PRUNE))
