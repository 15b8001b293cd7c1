"""Comparing, combining and cleaning collected saliency statistics (the library behind ``stats-*``).

- :func:`diff`        per-(layer, expert) difference of one metric between two files, with summary statistics
- :func:`rank_merge`  rank-based aggregation of several files: every file contributes equally, whatever its
                      sample count
- :func:`purge`       zero out the experts with too little routing evidence

All three take and return :class:`~mlx_fun.observe.saliency.SaliencyAccumulator` objects and never touch the inputs;
file I/O is the caller's business (the CLI uses ``SaliencyAccumulator.save`` and ``io.write_json``).

Rank-merged files
-----------------
``rank_merge`` stores ``extra["rank_sum_<metric>"]`` (float64, (num_layers, num_experts)), ``extra["rank_files"]``
(n) and ``extra["rank_metric"]``. Within each layer of each file the expert with the highest score gets rank 1
and the lowest rank ``num_experts`` (ties share their average rank), so a rank sum lies in
``[n, n * num_experts]`` and lower means more important. ``SaliencyAccumulator.scores(metric)`` turns it back
into "higher is better": ``n * (num_experts + 1) - rank_sum``, which is what ``prune`` ranks experts by.

Rank sums are order-independent (the merge is commutative) and ``rank_merge([A, B, C])`` holds exactly
``rank(A) + rank(B) + rank(C)``. Merging an already-merged file is *not* the same thing:
``rank_merge([rank_merge([A, B]), C])`` re-ranks the merged scores, so the result generally differs from
``rank_merge([A, B, C])``. Merge the original files in one call.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import UserError, param
from .saliency import ARRAY_KEYS, METRICS, SaliencyAccumulator, check_same_model

TOP_N = 10


# ---------------------------------------------------------------------------------------------- helpers
def _check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise UserError(f"unknown metric '{metric}'; choose one of {', '.join(METRICS)}.")


def check_distinct(accs: Sequence[SaliencyAccumulator], labels: Sequence[str]) -> None:
    """Raise a ``UserError`` when two inputs hold exactly the same statistics (the same file given twice, or a
    copy): a diff of it is zero and a rank merge would count one dataset twice."""
    for i in range(len(accs)):
        for j in range(i):
            a, b = accs[j], accs[i]
            if a.total_tokens == b.total_tokens and all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ARRAY_KEYS):
                raise UserError(f"{labels[i]} holds exactly the same statistics as {labels[j]} (the same file twice?); "
                                "give saliency files of different runs.")


def _norm_warnings(accs, labels, metric: str) -> list[str]:
    """reap/ean need output norms; a frequency-only file scores 0 everywhere, which is worth a warning."""
    if metric not in ("reap", "ean"):
        return []
    out = []
    for acc, label in zip(accs, labels):
        if f"rank_sum_{metric}" in acc.extra:
            continue
        if not acc.has_norms:
            out.append(
                f"{label} has no output norms (reap_count is 0 everywhere, collected frequency-only), so its "
                f"'{metric}' scores are all 0; use --metric freq or weighted_freq, or re-collect with norms."
            )
    return out


def _entry(acc: SaliencyAccumulator, layer: int, expert: int, d: float, v1: float, v2: float) -> dict:
    return {
        "layer": int(layer),
        "moe_layer": int(acc.moe_layer_indices[layer]),
        "expert": int(expert),
        "diff": float(d),
        "value1": float(v1),
        "value2": float(v2),
    }


# ---------------------------------------------------------------------------------------------- diff
def diff(
    a: SaliencyAccumulator,
    b: SaliencyAccumulator,
    metric: str = "reap",
    *,
    labels: Sequence[str] = ("file1", "file2"),
    top_n: int = TOP_N,
) -> dict:
    """Compare ``metric`` between two files of the same model: ``diff = scores(a) - scores(b)``.

    Returns a JSON-serialisable report::

        metric, model_type, num_layers, num_experts, moe_layer_indices, shape
        stats:         mean, std (population), min, max of the diff over all (layer, expert) pairs
        distribution:  positive (a > b), negative (a < b), zero (exactly equal), total
        top_positive:  up to ``top_n`` largest positive diffs, largest first
        top_negative:  up to ``top_n`` most negative diffs, most negative first
        warnings:      e.g. a file without output norms compared on reap/ean
        diff:          the full (num_layers, num_experts) diff as nested lists

    Each top entry is ``{layer, moe_layer, expert, diff, value1, value2}``: ``layer`` is the position among
    the MoE layers, ``moe_layer`` the decoder-layer index, ``value1``/``value2`` the scores in ``a``/``b``.
    Only strictly positive (negative) diffs enter ``top_positive`` (``top_negative``); equal diffs keep
    (layer, expert) order.
    """
    _check_metric(metric)
    check_same_model([a, b], labels)
    check_distinct([a, b], labels)
    s1, s2 = a.scores(metric), b.scores(metric)
    d = s1 - s2
    flat = d.reshape(-1)
    E = a.num_experts

    order_desc = np.argsort(-flat, kind="stable")
    order_asc = np.argsort(flat, kind="stable")
    top_pos = [i for i in order_desc[:top_n] if flat[i] > 0]
    top_neg = [i for i in order_asc[:top_n] if flat[i] < 0]

    def entries(idx):
        return [_entry(a, i // E, i % E, flat[i], s1.flat[i], s2.flat[i]) for i in idx]

    return {
        "metric": metric,
        "model_type": a.model_type if a.model_type != "unknown" else b.model_type,
        "num_layers": a.num_layers,
        "num_experts": a.num_experts,
        "moe_layer_indices": list(a.moe_layer_indices),
        "shape": [a.num_layers, a.num_experts],
        "stats": {
            "mean": float(flat.mean()),
            "std": float(flat.std()),
            "min": float(flat.min()),
            "max": float(flat.max()),
        },
        "distribution": {
            "positive": int((flat > 0).sum()),
            "negative": int((flat < 0).sum()),
            "zero": int((flat == 0).sum()),
            "total": int(flat.size),
        },
        "top_positive": entries(top_pos),
        "top_negative": entries(top_neg),
        "warnings": _norm_warnings([a, b], labels, metric),
        "diff": d.tolist(),
    }


def diff_files(file1, file2, metric: str = "reap") -> dict:
    """The ``stats-diff`` report: :func:`diff` of two saliency files (each loaded by the one reader, errors naming
    ``file1`` / ``file2``) with the file names first. The job and the dashboard's Diff tab both call it."""
    a, b = SaliencyAccumulator.load(file1, name="file1"), SaliencyAccumulator.load(file2, name="file2")
    return {"file1": str(file1), "file2": str(file2), **diff(a, b, metric, labels=(str(file1), str(file2)))}


# ---------------------------------------------------------------------------------------------- merge
def layer_ranks(scores: np.ndarray) -> np.ndarray:
    """Rank experts within each layer: 1 = highest score, num_experts = lowest; ties get their average rank (what
    ``scipy.stats.rankdata(-scores, method="average", axis=1)`` gives, NaN rows included, without importing
    scipy.stats: 1-2 s of a stats-merge that takes 0.1 s)."""
    values = -np.asarray(scores, dtype=np.float64)
    ranks = np.full(values.shape, np.nan)
    for row, out in zip(values, ranks):  # one layer each (rows of the 2-D arrays, views)
        if np.isnan(row).any():  # scipy's nan_policy="propagate": the whole row is NaN
            continue
        order = np.argsort(row, kind="stable")
        ordered = row[order]
        first = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])  # where each run of equal values starts
        ends = np.r_[first[1:], ordered.size]
        out[order] = np.repeat((first + 1 + ends) / 2.0, ends - first)  # positions first+1 .. ends, averaged
    return ranks


def rank_merge(
    accs: Sequence[SaliencyAccumulator],
    metric: str = "reap",
    *,
    labels: Sequence[str] | None = None,
) -> SaliencyAccumulator:
    """Rank-based aggregation of ``accs`` (at least 2 files of the same model) by ``metric``.

    The result holds the raw arrays summed over the files (``max_activation_norm``: the maximum),
    ``total_tokens`` summed, and ``extra`` = ``rank_sum_<metric>`` (sum of per-layer ranks, float64),
    ``rank_files`` (n) and ``rank_metric``. ``result.scores(metric)`` = ``n * (num_experts + 1) - rank_sum``,
    higher = more important. Any ``rank_*`` entries of the inputs are not carried over; their provenance fields
    are, where every input records the same value (the model, when all were collected on it).
    """
    _check_metric(metric)
    accs = list(accs)
    if len(accs) < 2:
        raise UserError(
            f"rank merging needs at least 2 saliency files, got {len(accs)}; pass {param('files')} more than once."
        )
    labels = list(labels) if labels is not None else [f"file {i + 1}" for i in range(len(accs))]
    check_same_model(accs, labels)
    check_distinct(accs, labels)

    first = accs[0]
    model_type = next((x.model_type for x in accs if x.model_type != "unknown"), "unknown")
    merged = SaliencyAccumulator(
        first.num_layers,
        first.num_experts,
        model_type=model_type,
        moe_layer_indices=first.moe_layer_indices,
        top_k=max(x.top_k for x in accs),
    )
    rank_sum = np.zeros((first.num_layers, first.num_experts), dtype=np.float64)
    for acc in accs:
        rank_sum += layer_ranks(acc.scores(metric))
        merged.add(acc)  # raw arrays summed, max norm maxed, tokens added

    from .provenance import common

    merged.provenance = common([acc.provenance for acc in accs])
    merged.extra = {
        f"rank_sum_{metric}": rank_sum,
        "rank_files": np.array(float(len(accs))),
        "rank_metric": np.array(metric),
    }
    return merged


def merge_warnings(accs: Sequence[SaliencyAccumulator], metric: str, labels: Sequence[str]) -> list[str]:
    """Warnings worth printing before a rank merge (files that cannot rank experts by ``metric``)."""
    return _norm_warnings(accs, labels, metric)


# ---------------------------------------------------------------------------------------------- purge
def refuse_purging_everything(acc: SaliencyAccumulator, min_freq: float | None, min_count: float | None) -> None:
    """For a :func:`purge` that kept no expert (a file that ranks nothing, not worth writing): a one-line
    ``UserError`` naming the filter and the largest value of its statistic (a threshold at or below it keeps
    that expert)."""
    for name, value, stat in (("min_freq", min_freq, "freq"), ("min_count", min_count, "reap_count")):
        values = getattr(acc, stat)
        if value is not None and (values < value).all():
            top = float(np.max(values))
            raise UserError(f"{param(name)} {value:g} purges every expert (the largest {stat} in the file is "
                            f"{top:g}): the file would rank nothing; pass a {param(name)} of at most {top:g}.")
    raise UserError(f"{param('min_freq')} {min_freq:g} and {param('min_count')} {min_count:g} together purge every "
                    f"expert: the file would rank nothing; lower one of them.")


def purge(
    acc: SaliencyAccumulator,
    min_freq: float | None = None,
    min_count: float | None = None,
    max_norm: float | None = None,
) -> tuple[SaliencyAccumulator, dict]:
    """Zero out the (layer, expert) entries with ``freq < min_freq`` or ``reap_count < min_count``.

    Every array of a purged entry becomes 0 (same shape as the input). In a rank-merged file the entry's rank
    sum is set to ``n * (num_experts + 1)``, so its score is 0 too and it ranks below every kept expert.
    ``max_norm`` only reports the entries whose ``max_activation_norm`` exceeds it (it caps and zeros nothing).
    ``acc`` is left untouched.

    Report: ``total``, ``purged``, ``kept``, ``by_filter`` (``freq``, ``count``, ``norm_over``; an entry
    below both thresholds counts under both, ``purged`` counts it once), the thresholds, ``norm_over_entries``
    (``{layer, moe_layer, expert, max_activation_norm}``, checked on the input) and ``layers_fully_purged``.
    """
    if min_freq is None and min_count is None and max_norm is None:
        raise UserError(f"stats-purge needs at least one filter: {param('min_freq')}, {param('min_count')} or "
                        f"{param('max_norm')}.")
    for name, value in (("min_freq", min_freq), ("min_count", min_count), ("max_norm", max_norm)):
        if value is not None and (not np.isfinite(value) or value < 0):
            raise UserError(f"{param(name)} must be a non-negative number, got {value}.")
    if min_count is not None and min_count > 0 and not acc.has_norms:
        raise UserError(
            f"{param('min_count')} filters on reap_count, but this file has reap_count 0 everywhere (collected "
            f"frequency-only), so every expert would be purged; use {param('min_freq')} instead."
        )

    L, E = acc.num_layers, acc.num_experts
    low_freq = acc.freq < min_freq if min_freq is not None else np.zeros((L, E), dtype=bool)
    low_count = acc.reap_count < min_count if min_count is not None else np.zeros((L, E), dtype=bool)
    norm_over = acc.max_activation_norm > max_norm if max_norm is not None else np.zeros((L, E), dtype=bool)
    mask = low_freq | low_count

    out = SaliencyAccumulator(
        L, E, model_type=acc.model_type, moe_layer_indices=acc.moe_layer_indices, top_k=acc.top_k
    )
    out.total_tokens = acc.total_tokens
    out.provenance = dict(acc.provenance)  # the same model and data, fewer experts
    for key in ARRAY_KEYS:
        arr = getattr(acc, key).copy()
        arr[mask] = 0.0
        setattr(out, key, arr)
    out.extra = {k: np.array(v, copy=True) for k, v in acc.extra.items()}
    n_files = float(out.extra.get("rank_files", np.array(1.0)))
    for key, value in out.extra.items():
        if key.startswith("rank_sum_") and value.shape == (L, E):
            value[mask] = n_files * (E + 1)  # score n*(E+1) - rank_sum = 0

    report = {
        "total": int(L * E),
        "purged": int(mask.sum()),
        "kept": int(L * E - mask.sum()),
        "by_filter": {
            "freq": int(low_freq.sum()),
            "count": int(low_count.sum()),
            "norm_over": int(norm_over.sum()),
        },
        "min_freq": min_freq,
        "min_count": min_count,
        "max_norm": max_norm,
        "norm_over_entries": [
            {
                "layer": int(l),
                "moe_layer": int(acc.moe_layer_indices[l]),
                "expert": int(e),
                "max_activation_norm": float(acc.max_activation_norm[l, e]),
            }
            for l, e in zip(*np.nonzero(norm_over))
        ],
        "layers_fully_purged": [int(l) for l in np.nonzero(mask.all(axis=1))[0]],
    }
    return out, report
