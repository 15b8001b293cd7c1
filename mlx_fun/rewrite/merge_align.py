"""REAM's steps 5 and 6 (:mod:`mlx_fun.rewrite.merge`): a group member's intermediate neurons aligned onto its
centroid's (the cost of every pairing, then an exact or greedy assignment), and the saliency-weighted average of the
aligned experts' weights (dequantized one expert at a time, re-quantized like the tensor they came from)."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from ..adapters.base import expert_projections, intermediate
from ..errors import UserError
from .merge_options import ALIGNMENTS
from .weights import dense

_EPS = 1e-12


def unit_rows(a: np.ndarray) -> np.ndarray:
    return a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), _EPS)


# ================================================================================================ alignment
def alignment_cost(act_c: np.ndarray, act_m: np.ndarray, feat_c: np.ndarray, feat_m: np.ndarray) -> np.ndarray:
    """(I, I) cost of pairing centroid neuron ``a`` (row) with member neuron ``b`` (column).

    ``act_*`` are (N, I) intermediate activations on the same tokens, ``feat_*`` (I, F) weight features;
    both are unit-normalised per neuron, and the cost is the sum of the two squared distances.
    """
    ac = unit_rows(np.asarray(act_c, dtype=np.float64).T)
    am = unit_rows(np.asarray(act_m, dtype=np.float64).T)
    fc = unit_rows(np.asarray(feat_c, dtype=np.float64))
    fm = unit_rows(np.asarray(feat_m, dtype=np.float64))
    return (2.0 - 2.0 * ac @ am.T) + (2.0 - 2.0 * fc @ fm.T)


def align_permutation(cost: np.ndarray, method: str = "hungarian") -> np.ndarray:
    """``perm`` with ``perm[a]`` = the member neuron placed at centroid neuron ``a`` (a permutation of 0..I-1)."""
    cost = np.asarray(cost, dtype=np.float64)
    n = cost.shape[0]
    if method == "none":
        return np.arange(n)
    if method == "hungarian":
        from scipy.optimize import linear_sum_assignment

        rows, cols = linear_sum_assignment(cost)
        perm = np.empty(n, dtype=np.int64)
        perm[rows] = cols
        return perm
    if method == "greedy":
        perm = np.full(n, -1, dtype=np.int64)
        free = np.ones(n, dtype=bool)
        for a in np.lexsort((np.arange(n), cost.min(axis=1))):  # most confident neurons first
            row = np.where(free, cost[a], np.inf)
            b = int(np.argmin(row))
            perm[a] = b
            free[b] = False
        return perm
    raise UserError(f"unknown alignment '{method}'; choose one of {', '.join(ALIGNMENTS)}.")


# ================================================================================================ expert weights
def expert_weights(experts, e: int) -> dict[str, mx.array | None]:
    """float32 (out, in) weights of expert ``e`` keyed by projection name (``gate_proj``/``up_proj``/``down_proj``
    of a SwitchGLU, ``fc1``/``fc2`` of a SwitchMLP), and their biases under ``<name>_bias`` (``None`` where absent)."""
    ins, out_name = expert_projections(experts)
    out: dict[str, mx.array | None] = {}
    for name in (*ins, out_name):
        lin = getattr(experts, name)
        out[name] = dense(lin, e)
        out[name + "_bias"] = lin["bias"][e].astype(mx.float32) if "bias" in lin else None
    return out


def intermediate_activations(experts, w: dict, x: mx.array) -> mx.array:
    """(N, I) activations of one expert on ``x`` (N, D), through the family's own activation function."""
    pre = {}
    for name in expert_projections(experts)[0]:
        pre[name] = x @ w[name].T
        if w[name + "_bias"] is not None:
            pre[name] = pre[name] + w[name + "_bias"]
    return intermediate(experts, pre)


def weight_features(experts, w: dict) -> mx.array:
    """(I, F): the input projections' rows ‖ the output projection's column of every intermediate neuron."""
    ins, out_name = expert_projections(experts)
    return mx.concatenate([w[name] for name in ins] + [w[out_name].T], axis=1)


def permute_expert(experts, w: dict, perm: np.ndarray) -> dict:
    """Expert weights with intermediate neuron ``perm[a]`` moved to position ``a``."""
    ins, out_name = expert_projections(experts)
    p = mx.array(perm.astype(np.int32))
    out = dict(w)
    for key in ins:
        out[key] = w[key][p]
        if w[key + "_bias"] is not None:
            out[key + "_bias"] = w[key + "_bias"][p]
    out[out_name] = w[out_name][:, p]
    return out


def merge_group(
    experts, members: Sequence[int], weights: Sequence[float], x_align: mx.array | None, alignment: str
) -> dict:
    """Saliency-weighted average of the members (``members[0]`` is the centroid) after aligning each onto it."""
    base = expert_weights(experts, members[0])
    need_align = alignment != "none"
    if need_align:
        act_c = np.array(intermediate_activations(experts, base, x_align))
        feat_c = np.array(weight_features(experts, base))
    merged = {k: (None if v is None else v * float(weights[0])) for k, v in base.items()}
    for m, wt in zip(members[1:], weights[1:]):
        w = expert_weights(experts, m)
        if need_align:
            cost = alignment_cost(
                act_c, np.array(intermediate_activations(experts, w, x_align)), feat_c, np.array(weight_features(experts, w))
            )
            w = permute_expert(experts, w, align_permutation(cost, alignment))
        for k, v in w.items():
            if v is not None:
                merged[k] = merged[k] + v * float(wt)
        mx.eval([v for v in merged.values() if v is not None])
    return merged
