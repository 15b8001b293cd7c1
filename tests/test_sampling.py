"""The Gumbel-max sampler: determinism, greedy limits, masks, and the sampled distribution."""

from __future__ import annotations

import math
import time

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chisquare

from mlx_fun.model import sampling
from mlx_fun.model.sampling import (
    U_MAX,
    U_MIN,
    GumbelSampler,
    clipped_uniform,
    gumbel_argmax,
    gumbel_noise,
    keys_for_seeds,
    make_sampler,
    mask_logits,
    sample,
    seed_key,
    top_k_mask,
    top_p_mask,
)

LOGITS8 = [2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -3.0]
N_SEEDS = 20_000


def _np(a) -> np.ndarray:
    return np.array(a)


def _softmax(logits, temperature=1.0) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(x - x.max())
    return p / p.sum()


def _draw_per_seed(logits, temperature, seeds, **kw) -> np.ndarray:
    """One token per seed, each drawn with ``mx.random.key(seed)``, all at once through ``mx.vmap``."""
    logits = mx.array(logits)
    fn = mx.vmap(lambda k: sample(logits, temperature, k, **kw))
    return _np(fn(keys_for_seeds(seeds)))


def _gapped_logits(rows: int, vocab: int, gap: float, seed: int = 0) -> mx.array:
    """Random logits whose maximum beats the runner-up by at least ``gap`` in every row."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, vocab)).astype(np.float32)
    top = x.argmax(axis=1)
    x[np.arange(rows), top] = np.sort(x, axis=1)[:, -2] + gap
    return mx.array(x)


# ------------------------------------------------------------------------------------------------ keys and noise


def test_keys_for_seeds_match_mx_random_key():
    seeds = [0, 1, 7, 2**31, 2**32 + 5, 2**40 + 3]
    keys = _np(keys_for_seeds(seeds))
    assert keys.dtype == np.uint32 and keys.shape == (len(seeds), 2)
    for row, s in zip(keys, seeds):
        np.testing.assert_array_equal(row, _np(mx.random.key(s)))
    np.testing.assert_array_equal(_np(seed_key(10, 5)), _np(mx.random.key(15)))


def test_uniform_is_strictly_inside_and_noise_is_finite():
    assert 0.0 < U_MIN and U_MAX < 1.0
    assert np.float32(U_MAX) < np.float32(1.0) and np.float32(U_MIN) > 0
    for u in (U_MIN, U_MAX):  # the extreme clipped values still give finite noise in float32
        g = -mx.log(-mx.log(mx.array(u, dtype=mx.float32)))
        assert math.isfinite(g.item())
    u = clipped_uniform((1_000_000,), mx.random.key(0))
    assert u.dtype == mx.float32
    assert mx.min(u).item() >= U_MIN and mx.max(u).item() <= U_MAX
    g = gumbel_noise((1_000_000,), mx.random.key(1))
    assert mx.all(mx.isfinite(g)).item()
    # standard Gumbel: mean = Euler–Mascheroni constant, variance = π²/6
    assert abs(mx.mean(g).item() - 0.5772) < 0.01
    assert abs(mx.var(g).item() - math.pi**2 / 6) < 0.02


def test_clip_rescues_the_endpoints():
    u = mx.clip(mx.array([0.0, 1.0]), U_MIN, U_MAX)
    assert mx.all(mx.isfinite(-mx.log(-mx.log(u)))).item()


# --------------------------------------------------------------------------------------------------- determinism


def test_same_seed_same_tokens():
    logits = mx.random.normal((4, 1000), key=mx.random.key(0))
    for t in (0.5, 1.0, 2.0):
        a = sample(logits, t, seed_key(123))
        b = sample(logits, t, seed_key(123))
        np.testing.assert_array_equal(_np(a), _np(b))
    s1, s2 = GumbelSampler(1.0, seed=42), GumbelSampler(1.0, seed=42)
    seq1 = [_np(s1(logits)) for _ in range(5)]
    seq2 = [_np(s2(logits)) for _ in range(5)]
    np.testing.assert_array_equal(np.stack(seq1), np.stack(seq2))
    s1.reset()
    np.testing.assert_array_equal(np.stack([_np(s1(logits)) for _ in range(5)]), np.stack(seq1))


def test_different_step_different_noise():
    shape = (2, 4096)
    g0 = _np(gumbel_noise(shape, seed_key(7, 0)))
    g1 = _np(gumbel_noise(shape, seed_key(7, 1)))
    assert not np.allclose(g0, g1)
    assert abs(np.corrcoef(g0.ravel(), g1.ravel())[0, 1]) < 0.05  # fresh, uncorrelated noise
    # rows of one (B, V) draw are independent too
    assert abs(np.corrcoef(g0[0], g0[1])[0, 1]) < 0.05
    # the sampler's step n uses key(seed + n), and its counter advances once per call
    flat = mx.zeros((1, 512))  # uniform distribution: the token is decided by the noise alone
    sampler = GumbelSampler(1.0, seed=7)
    toks = [int(sampler(flat).item()) for _ in range(6)]
    assert sampler.step == 6
    assert toks == [int(gumbel_argmax(flat, 1.0, mx.random.key(7 + n)).item()) for n in range(6)]
    assert len(set(toks)) > 1
    assert int(GumbelSampler(1.0, seed=7, step=3)(flat).item()) == toks[3]


def test_unseeded_uses_the_global_key_sequence():
    logits = mx.zeros((1, 1024))
    for compiled in (False, True):
        mx.random.seed(5)
        a = [int(gumbel_argmax(logits, 1.0, compiled=compiled).item()) for _ in range(8)]
        mx.random.seed(5)
        b = [int(gumbel_argmax(logits, 1.0, compiled=compiled).item()) for _ in range(8)]
        assert a == b and len(set(a)) > 1  # reproducible from mx.random.seed, and the state advances


def test_compiled_and_plain_agree():
    logits = mx.random.normal((3, 777), key=mx.random.key(1))
    for t in (0.3, 1.0, mx.array(0.8), mx.array(0.0)):
        for s in range(5):
            a = gumbel_argmax(logits, t, mx.random.key(s), compiled=False)
            b = gumbel_argmax(logits, t, mx.random.key(s), compiled=True)
            np.testing.assert_array_equal(_np(a), _np(b))


def test_changing_temperature_does_not_retrace(monkeypatch):
    calls = []
    real = sampling.gumbel_noise

    def counting(shape, key=None):
        calls.append(tuple(shape))
        return real(shape, key)

    monkeypatch.setattr(sampling, "gumbel_noise", counting)
    logits = mx.random.normal((3, 37), key=mx.random.key(2))  # a shape no other test compiles
    outs = []
    for t in (0.25, 0.5, 1.0, 2.0, 4.0, 0.0):
        outs.append(_np(gumbel_argmax(logits, mx.array(t), mx.random.key(9), compiled=True)))
    assert calls == [(3, 37)], "the compiled graph must take the temperature as an input"
    np.testing.assert_array_equal(outs[-1], _np(mx.argmax(logits, axis=-1)))


# --------------------------------------------------------------------------------------------- greedy limits


@pytest.mark.parametrize("compiled", [False, True])
def test_tiny_temperature_is_argmax(compiled):
    logits = _gapped_logits(64, 2000, gap=0.01)
    want = _np(mx.argmax(logits, axis=-1))
    for s in range(20):
        got = gumbel_argmax(logits, 1e-4, mx.random.key(s), compiled=compiled)
        np.testing.assert_array_equal(_np(got), want)
        np.testing.assert_array_equal(_np(gumbel_argmax(logits, mx.array(1e-4), mx.random.key(s))), want)


def test_zero_temperature_is_exact_argmax():
    # exact ties, -inf, huge values and low precision: still exactly mx.argmax's answer
    rows = [
        [0.0, 3.0, 3.0, -1.0, 2.999],
        [-float("inf"), -5.0, -5.0, -float("inf"), -6.0],
        [1e30, -1e30, 1e30, 0.0, 5.0],
        [0.0, 0.0, 0.0, 0.0, 0.0],
    ]
    for dtype in (mx.float32, mx.bfloat16, mx.float16):
        logits = mx.array(rows, dtype=dtype)
        want = _np(mx.argmax(logits, axis=-1))
        for t in (0, 0.0, mx.array(0.0)):
            for compiled in (False, True):
                got = sample(logits, t, mx.random.key(3), compiled=compiled)
                np.testing.assert_array_equal(_np(got), want)
        np.testing.assert_array_equal(_np(make_sampler(temp=0)(logits)), want)
        np.testing.assert_array_equal(_np(make_sampler(temp=0, top_k=2, top_p=0.5)(logits)), want)
    big = mx.random.normal((8, 151_936), key=mx.random.key(4))
    np.testing.assert_array_equal(_np(sample(big, 0.0)), _np(mx.argmax(big, axis=-1)))


def test_top_k_one_is_argmax():
    logits = _gapped_logits(16, 300, gap=1e-3, seed=2)
    want = _np(mx.argmax(logits, axis=-1))
    for t in (0.5, 1.0, 10.0):
        for s in range(10):
            np.testing.assert_array_equal(_np(sample(logits, t, mx.random.key(s), top_k=1)), want)
    # and over thousands of seeds on a flat-ish distribution
    toks = _draw_per_seed(LOGITS8, 5.0, range(5000), top_k=1)
    assert set(toks.tolist()) == {0}


# --------------------------------------------------------------------------------------------------------- shapes


def test_shapes_and_batch_rows_are_independent():
    v = mx.array(LOGITS8)
    tok = sample(v, 1.0, mx.random.key(0))
    assert tok.shape == () and tok.dtype == mx.uint32
    batch = mx.broadcast_to(v, (4096, 8))
    toks = sample(batch, 1.0, mx.random.key(0))
    assert toks.shape == (4096,)
    # identical rows, one key: every row gets its own noise, so the rows follow softmax independently
    counts = np.bincount(_np(toks), minlength=8)
    assert 0.5 * np.abs(counts / 4096 - _softmax(LOGITS8)).sum() < 0.05
    sampler = GumbelSampler(1.0, seed=1)
    assert sampler(batch[:3]).shape == (3,)


# ---------------------------------------------------------------------------------------------------------- masks


def test_top_k_mask_keeps_the_k_largest():
    logits = mx.array([[0.1, 5.0, -2.0, 3.0, 4.0, -1.0], [9.0, 8.0, 7.0, 6.0, 5.0, 4.0]])
    kept = np.isfinite(_np(top_k_mask(logits, 3)))
    np.testing.assert_array_equal(kept, [[0, 1, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(_np(top_k_mask(logits, 3))[kept], _np(logits)[kept])  # kept values untouched
    assert top_k_mask(logits, 0) is logits and top_k_mask(logits, 6) is logits


def test_top_p_mask_keeps_the_nucleus():
    probs = np.array([0.05, 0.4, 0.1, 0.3, 0.15])  # sorted: 0.4, 0.3, 0.15, 0.1, 0.05
    logits = mx.array(np.log(probs).astype(np.float32))
    for top_p, want in [
        (0.35, [0, 1, 0, 0, 0]),
        (0.6, [0, 1, 0, 1, 0]),
        (0.8, [0, 1, 0, 1, 1]),
        (0.9, [0, 1, 1, 1, 1]),
        (0.99, [1, 1, 1, 1, 1]),
    ]:
        np.testing.assert_array_equal(np.isfinite(_np(top_p_mask(logits, top_p))), want, err_msg=str(top_p))
    # shift invariance (raw logits or log-probabilities) and ties at the threshold are kept
    np.testing.assert_array_equal(_np(top_p_mask(logits + 7.0, 0.6)) - 7.0, _np(top_p_mask(logits, 0.6)))
    tied = mx.array([1.0, 1.0, 0.0, -1.0])
    np.testing.assert_array_equal(np.isfinite(_np(top_p_mask(tied, 0.3))), [1, 1, 0, 0])
    # both masks: the intersection
    both = np.isfinite(_np(mask_logits(logits, top_k=1, top_p=0.9)))
    np.testing.assert_array_equal(both, [0, 1, 0, 0, 0])


@pytest.mark.parametrize("kw, allowed", [
    ({"top_k": 3}, {0, 6, 1}),
    ({"top_p": 0.75}, {0, 6, 1}),  # softmax(LOGITS8): 0.38, 0.23(#6), 0.14(#1) = 0.75.. → {0, 6, 1}
    ({"top_k": 2, "top_p": 0.75}, {0, 6}),
])
def test_masked_tokens_are_never_sampled(kw, allowed):
    p = _softmax(LOGITS8)
    assert p[[0, 6]].sum() < 0.75 <= p[[0, 6, 1]].sum()
    for t in (1.0, 3.0, 50.0):  # hot temperatures make the masked tail likely if the mask leaked
        toks = _draw_per_seed(LOGITS8, t, range(10_000), **kw)
        assert set(toks.tolist()) == allowed, (kw, t)
    # the batch path too
    batch = mx.broadcast_to(mx.array(LOGITS8), (10_000, 8))
    assert set(_np(sample(batch, 50.0, mx.random.key(1), **kw)).tolist()) == allowed


def test_masked_distribution_is_renormalised_softmax():
    toks = _draw_per_seed(LOGITS8, 0.7, range(N_SEEDS), top_k=4)
    keep = np.argsort(LOGITS8)[-4:]
    p = np.zeros(8)
    p[keep] = _softmax(np.asarray(LOGITS8)[keep], 0.7)
    counts = np.bincount(toks, minlength=8)
    assert counts[p == 0].sum() == 0
    assert chisquare(counts[keep], p[keep] * N_SEEDS).pvalue > 1e-3


# -------------------------------------------------------------------------------------------------- distribution


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_frequencies_match_softmax(temperature):
    start = time.perf_counter()
    toks = _draw_per_seed(LOGITS8, temperature, range(N_SEEDS))
    elapsed = time.perf_counter() - start
    p = _softmax(LOGITS8, temperature)
    counts = np.bincount(toks, minlength=8)
    assert counts.sum() == N_SEEDS
    expected = p * N_SEEDS
    pvalue = chisquare(counts, expected * (N_SEEDS / expected.sum())).pvalue
    tv = 0.5 * np.abs(counts / N_SEEDS - p).sum()
    assert pvalue > 1e-3 and tv < 0.02, (pvalue, tv, counts, expected)
    assert elapsed < 5.0, elapsed
    # the same seeds drawn one by one give the same tokens (vmap is only a faster way to draw them)
    for s in (0, 1, 999, N_SEEDS - 1):
        assert int(sample(mx.array(LOGITS8), temperature, mx.random.key(s)).item()) == toks[s]


def test_temperature_is_a_live_argument():
    flat_ish = mx.array(LOGITS8)
    cold = _draw_per_seed(LOGITS8, 0.05, range(2000))
    hot = _draw_per_seed(LOGITS8, 20.0, range(2000))
    assert (cold == 0).mean() > 0.99
    assert len(set(hot.tolist())) == 8
    sampler = GumbelSampler(0.05, seed=0)
    a = int(sampler(flat_ish[None]).item())
    sampler.temperature = 0.0
    assert int(sampler(flat_ish[None]).item()) == 0 == a
    assert int(sampler(flat_ish[None], temperature=mx.array(0.0)).item()) == 0


# ----------------------------------------------------------------------------------------------------- argument checks


@pytest.mark.parametrize("kw", [{"temperature": -1.0}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}, {"seed": -3}])
def test_bad_arguments(kw):
    with pytest.raises(ValueError):
        GumbelSampler(**kw)


def test_repr():
    assert "greedy" in repr(make_sampler(0.0))
    r = repr(make_sampler(0.7, seed=3, top_k=20, top_p=0.9))
    assert "T=0.7" in r and "seed=3" in r and "top_k=20" in r and "top_p=0.9" in r


# ------------------------------------------------------------------------------- min-p and XTC, as mlx-lm's
def test_min_p_and_xtc_keep_what_mlx_lm_s_chain_keeps():
    """mlx_lm.generate's --min-p / --min-tokens-to-keep / --xtc-*: the same tokens survive our masks as mlx-lm's
    sampler chain (top-p, min-p, XTC, top-k, in that order), on raw logits and on log-probabilities alike."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, apply_xtc

    rng = np.random.default_rng(3)
    logits = mx.array(rng.normal(scale=2.0, size=(4, 64)).astype(np.float32))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    xtc = sampling.Xtc(1.0, 0.05, (3,))  # probability 1: mlx-lm's coin always applies it
    for top_p, min_p, keep, top_k in [(1.0, 0.1, 1, 0), (0.9, 0.2, 5, 0), (0.95, 0.05, 1, 8), (1.0, 0.0, 1, 0)]:
        theirs = logprobs
        if top_p < 1:
            theirs = apply_top_p(theirs, top_p)
        if min_p:
            theirs = apply_min_p(theirs, min_p, keep)
        theirs = apply_xtc(theirs, xtc.probability, xtc.threshold, list(xtc.special))
        if top_k:
            theirs = apply_top_k(theirs, top_k)
        for x in (logits, logprobs):
            ours = mask_logits(x, top_k, top_p, min_p=min_p, min_tokens_to_keep=keep, xtc=xtc)
            np.testing.assert_array_equal(np.isfinite(_np(ours)), np.isfinite(_np(theirs)),
                                          err_msg=str((top_p, min_p, keep, top_k)))
    assert not np.isfinite(_np(mask_logits(logits, min_p=0.5))).all()


def test_xtc_applies_with_its_probability_from_the_step_key():
    """XTC's coin comes from the step's key (split from it, so a seeded generation stays reproducible) and applies
    with the given probability; the most probable token goes whenever it does (it is above the threshold)."""
    logits = mx.array([[3.0, 2.9, 0.0, -1.0]])  # two tokens above the threshold: XTC drops the first
    hits = [int(sample(logits, 0.01, mx.random.key(s), xtc=sampling.Xtc(0.5, 0.1)).item()) for s in range(400)]
    share = hits.count(1) / len(hits)
    assert 0.4 < share < 0.6 and set(hits) == {0, 1}
    again = [int(sample(logits, 0.01, mx.random.key(s), xtc=sampling.Xtc(0.5, 0.1)).item()) for s in range(400)]
    assert hits == again
    sampler = GumbelSampler(1.0, seed=5, min_p=0.1, min_tokens_to_keep=2, xtc=sampling.Xtc(0.5, 0.2))
    assert "min_p=0.1/2" in repr(sampler) and "xtc=0.5@0.2" in repr(sampler)
