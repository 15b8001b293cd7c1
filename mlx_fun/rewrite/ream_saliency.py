"""REAM's expert saliency, measured layer by layer during the merge (``merge --saliency-source layerwise``, the
default): the paper's own code (SamsungSAILMontreal/ream, ``ream/merger.py`` calling ``ream/saliency.py``'s
``reap`` on the gated expert outputs of ``ream/moe_utils.py``'s ``run_all_experts``) scores the experts of each
layer on the hidden states that reach it *after the earlier layers were merged*, and takes the centroids (the
``E − n_prune`` most salient) and the merge weights from that score. For expert ``e``:

    s_e = (1 / n_batches) · Σ_batches  mean over the batch's tokens t routed to e of  p[t, e] · ‖p[t, e] · y[t, e]‖
        = (1 / n_batches) · Σ_batches  mean_t  p[t, e]² · ‖y[t, e]‖

- ``p = softmax(router logits)`` over all ``E`` experts, *not* renormalised over the top-k (the reference's
  similarity already gates the outputs with it, and its REAP multiplies the gated output by it once more); for
  sigmoid routers (DeepSeek, MiniMax) the same softmax of the raw logits, as the similarity uses.
- ``y[t, e]``: the expert's unweighted output (the hooked call's ``y``, in the experts' own space).
- "routed to e": ``e`` is among the token's selected experts (the family's own routing, as the hooked call ran it;
  for softmax routers the reference's top-k of ``p``). Padding tokens count nowhere.
- A batch is ``batch_size`` consecutive calibration samples (in dataset order, as the reference chunks its
  calibration tensor): an expert no token of a batch reaches adds 0 for that batch, so an expert reached in few
  batches scores lower than its per-token mean.
- Experts that score 0 get ``min(0.5, smallest non-zero score)`` (as the reference, so that an expert no token
  reached still carries a little weight in the group it joins).

The reference divides by ``max(1, samples // batch_size)`` (a partial last batch is summed but not counted);
this module divides by the number of batches, a factor common to every expert of a layer (the centroids and the
normalised merge weights do not change), except for the 0.5 cap above.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


#: ``ream_metadata.json``'s ``metric`` of a layerwise merge (:mod:`mlx_fun.rewrite.ream_saliency`)
LAYERWISE_METRIC = "ream layerwise: mean of p^2 * ||y|| over routed tokens, per batch, on the merged hidden states"


def routed_saliency(norms: np.ndarray, inds: np.ndarray, weights: np.ndarray, num_experts: int) -> np.ndarray:
    """REAP of the captured tokens: mean over the tokens routed to ``e`` of router weight × ‖y[t, e]‖ (the mixing
    weight, renormalised over the top-k where the family does; ``--saliency-source file`` without a file)."""
    inds = np.asarray(inds).astype(np.int64)
    w = np.asarray(weights, dtype=np.float64)
    rows = np.broadcast_to(np.arange(inds.shape[0])[:, None], inds.shape)
    total = np.zeros(num_experts)
    count = np.zeros(num_experts)
    np.add.at(total, inds.reshape(-1), (w * norms[rows, inds]).reshape(-1))
    np.add.at(count, inds.reshape(-1), 1.0)
    out = np.zeros(num_experts)
    np.divide(total, count, out=out, where=count > 0)
    return out


def routed_contributions(inds: mx.array, logits: mx.array, y: mx.array) -> mx.array:
    """(N, k) ``p[t, e]² · ‖y[t, e]‖`` of every token's selected experts (lazy): ``inds`` (..., k) the routing,
    ``logits`` (..., E) the raw router logits, ``y`` (..., k, D) the unweighted expert outputs."""
    k, E = inds.shape[-1], logits.shape[-1]
    probs = mx.softmax(logits.reshape(-1, E).astype(mx.float32), axis=-1, precise=True)
    p = mx.take_along_axis(probs, inds.reshape(-1, k).astype(mx.int32), axis=-1)
    norms = mx.linalg.norm(y.reshape(-1, k, y.shape[-1]).astype(mx.float32), axis=-1)
    return p * p * norms


class ReamSaliency:
    """Accumulates one layer's REAM saliency (see the module docstring) over the calibration batches.

    ``n_batches``: how many saliency batches the calibration samples make (``ceil(samples / batch_size)``)."""

    def __init__(self, num_experts: int, n_batches: int):
        self.num_experts, self.n_batches = int(num_experts), max(1, int(n_batches))
        self.reset()

    def reset(self) -> None:
        """Start a new layer."""
        self.total = np.zeros((self.n_batches, self.num_experts))
        self.count = np.zeros((self.n_batches, self.num_experts))

    def add(self, batch_of_token: np.ndarray, inds: np.ndarray, contributions: np.ndarray) -> None:
        """Add tokens: ``batch_of_token`` (N,) each token's saliency batch (< 0: padding, skipped), ``inds`` (N, k)
        its selected experts, ``contributions`` (N, k) their ``p² ‖y‖`` (:func:`routed_contributions`)."""
        rows = np.asarray(batch_of_token).reshape(-1)
        keep = rows >= 0
        inds = np.asarray(inds).reshape(rows.size, -1)[keep].astype(np.int64)
        c = np.asarray(contributions, dtype=np.float64).reshape(rows.size, -1)[keep]
        b = np.broadcast_to(rows[keep][:, None], inds.shape)
        np.add.at(self.total, (b, inds), c)
        np.add.at(self.count, (b, inds), 1.0)

    def scores(self) -> np.ndarray:
        """(E,) the layer's saliency: per-batch means averaged over the batches, zeros lifted (module docstring)."""
        means = np.zeros_like(self.total)
        np.divide(self.total, self.count, out=means, where=self.count > 0)
        s = means.sum(axis=0) / self.n_batches
        zero = s == 0
        if zero.any() and not zero.all():
            s[zero] = min(0.5, float(s[~zero].min()))
        return s


def batch_of_tokens(rows: np.ndarray, valid: np.ndarray, batch_size: int) -> np.ndarray:
    """(B·T,) the saliency batch of every token of a driver batch: sample ``rows[r]`` belongs to batch
    ``rows[r] // batch_size``; padding (``valid`` False) is -1."""
    ids = np.asarray(rows, dtype=np.int64)[:, None] // int(batch_size)
    return np.where(np.asarray(valid, dtype=bool), ids, -1).reshape(-1)


__all__ = ["LAYERWISE_METRIC", "ReamSaliency", "batch_of_tokens", "routed_contributions", "routed_saliency"]
