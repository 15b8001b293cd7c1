"""Per-layer × per-expert routing statistics, the saliency metrics computed from them, and ``.npz`` I/O.

Accumulators are numpy float64, fed once per forward with one ``np.bincount`` per array over its layers
(:meth:`~SaliencyAccumulator.update_layers`; :meth:`~SaliencyAccumulator.update`: one layer, ``np.add.at``):

- ``freq``               number of routed (token, expert) pairs
- ``weighted_freq_sum``  Σ router weight
- ``reap_sum``           Σ ‖y_e(x)‖ · w_e(x)   (REAP numerator)
- ``ean_sum``            Σ ‖y_e(x)‖            (EAN numerator)
- ``reap_count``         number of routed pairs that carried an output norm (REAP / EAN denominator)
- ``max_activation_norm`` max ‖y_e(x)‖ seen

Metrics (higher = more important): ``reap`` = reap_sum / reap_count, ``ean`` = ean_sum / reap_count,
``freq`` = freq, ``weighted_freq`` = weighted_freq_sum.

:meth:`SaliencyAccumulator.load` is the one reader of saliency ``.npz`` files and checks everything it reads
(one (num_layers, num_experts) shape, finite numbers, no negative count or norm, provenance fields that are text);
:meth:`~SaliencyAccumulator.ranking_scores` refuses a metric that ranks nothing (every expert tied: all 0 after
``stats-purge``, reap / ean of a frequency-only file).

A file ``collect`` writes also records where it came from (:attr:`SaliencyAccumulator.provenance`,
:mod:`mlx_fun.observe.provenance`): the model's name and weights fingerprint, the dataset and its samples' hash;
:meth:`~SaliencyAccumulator.check_provenance` warns when a job reads it for a model of other weights.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import numpy as np

from ..errors import UserError, param
from ..experts.selection import METRICS

ARRAY_KEYS = ("freq", "weighted_freq_sum", "reap_sum", "ean_sum", "reap_count", "max_activation_norm")
#: what names the model a file was collected on; all of it is checked before a file is used or combined
IDENTITY_KEYS = ("model_type", "top_k", "num_layers", "num_experts", "moe_layer_indices")
#: counts and output norms: never negative (router weights, and so weighted_freq_sum / reap_sum, carry their sign)
NON_NEGATIVE = ("freq", "reap_count", "ean_sum", "max_activation_norm")
#: what :meth:`SaliencyAccumulator.ranking_scores` ranks: experts within each layer, experts by their sums over
#: the layers (model-wide), or layers by their sums over the experts (quantize's cold layers)
RANKINGS = ("experts", "columns", "layers")
_NEEDS = {"reap": ("reap_sum", "reap_count"), "ean": ("ean_sum", "reap_count"), "freq": ("freq",),
          "weighted_freq": ("weighted_freq_sum",)}
FORMAT_VERSION = 1


class SaliencyAccumulator:
    """Routing statistics of one model: arrays of shape (num_layers, num_experts), float64."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        *,
        model_type: str = "unknown",
        moe_layer_indices: list[int] | None = None,
        top_k: int = 0,
    ):
        self.num_layers = int(num_layers)
        self.num_experts = int(num_experts)
        self.model_type = model_type
        self.moe_layer_indices = list(moe_layer_indices) if moe_layer_indices is not None else list(range(num_layers))
        self.top_k = int(top_k)
        self.total_tokens = 0
        self.extra: dict[str, np.ndarray] = {}  # e.g. rank_sum of a stats-merge result
        self.adapter: dict | None = None  # the LoRA adapter fused into the model (mlx_fun.model.lora.describe)
        self.source = "saliency file"  # how messages name these statistics (load: the parameter and path)
        self.missing: list[str] = []  # ARRAY_KEYS the loaded file did not hold (left 0)
        self.provenance: dict[str, str] = {}  # where the statistics came from (provenance.FIELDS), when recorded
        for key in ARRAY_KEYS:
            setattr(self, key, np.zeros((self.num_layers, self.num_experts), dtype=np.float64))

    @classmethod
    def for_adapter(cls, adapter) -> "SaliencyAccumulator":
        return cls(
            len(adapter.moe_layers()),
            adapter.num_experts,
            model_type=adapter.model_type,
            moe_layer_indices=adapter.moe_layers(),
            top_k=adapter.top_k,
        )

    # ------------------------------------------------------------------ feeding
    def update(self, layer: int, inds, weights, norms=None) -> None:
        """Add one batch of routing decisions of MoE layer ``layer`` (position in ``moe_layer_indices``).

        ``inds`` and ``weights`` are (N, k); ``norms`` (N, k) output norms or None (frequency-only counting).
        """
        inds = np.asarray(inds).reshape(-1)
        w = np.asarray(weights, dtype=np.float64).reshape(-1)
        np.add.at(self.freq[layer], inds, 1.0)
        np.add.at(self.weighted_freq_sum[layer], inds, w)
        if norms is not None:
            n = np.asarray(norms, dtype=np.float64).reshape(-1)
            np.add.at(self.reap_sum[layer], inds, n * w)
            np.add.at(self.ean_sum[layer], inds, n)
            np.add.at(self.reap_count[layer], inds, 1.0)
            np.maximum.at(self.max_activation_norm[layer], inds, n)

    def update_layers(self, inds, weights, norms=None, layers=None) -> None:
        """Add one forward's routing decisions of *every* MoE layer at once: ``inds``/``weights``/``norms`` are
        (num_layers, N, k), or (len(layers), N, k) for the layer positions ``layers``. Same sums as :meth:`update`
        per layer, in one ``np.bincount`` per array."""
        inds = np.asarray(inds)
        L, E = self.num_layers, self.num_experts
        rows = np.arange(L, dtype=np.int64) if layers is None else np.asarray(layers, dtype=np.int64)
        flat = (inds.reshape(len(rows), -1).astype(np.int64) + (rows * E)[:, None]).reshape(-1)
        w = np.asarray(weights, dtype=np.float64).reshape(-1)
        counts = np.bincount(flat, minlength=L * E).reshape(L, E)
        self.freq += counts
        self.weighted_freq_sum += np.bincount(flat, weights=w, minlength=L * E).reshape(L, E)
        if norms is not None:
            n = np.asarray(norms, dtype=np.float64).reshape(-1)
            self.reap_sum += np.bincount(flat, weights=n * w, minlength=L * E).reshape(L, E)
            self.ean_sum += np.bincount(flat, weights=n, minlength=L * E).reshape(L, E)
            self.reap_count += counts
            np.maximum.at(self.max_activation_norm.reshape(-1), flat, n)

    def add(self, other: "SaliencyAccumulator") -> None:
        """Sum another accumulator of the same model into this one (e.g. from another process)."""
        check_same_model([self, other], ["this accumulator", "the other"])
        for key in ARRAY_KEYS:
            if key == "max_activation_norm":
                np.maximum(self.max_activation_norm, other.max_activation_norm, out=self.max_activation_norm)
            else:
                getattr(self, key)[...] += getattr(other, key)
        self.total_tokens += other.total_tokens

    def reset(self) -> None:
        for key in ARRAY_KEYS:
            getattr(self, key)[...] = 0.0
        self.total_tokens = 0

    # ------------------------------------------------------------------ metrics
    def scores(self, metric: str = "reap") -> np.ndarray:
        """(num_layers, num_experts) saliency; higher means more important. Unseen experts score 0."""
        if metric not in METRICS:
            raise UserError(f"unknown metric '{metric}'; choose one of {', '.join(METRICS)}.")
        rank_key = f"rank_sum_{metric}"
        if rank_key in self.extra:
            # a rank-merged file: rank 1 is best, so invert into "higher is better"
            n_files = float(self.extra.get("rank_files", np.array(1.0)))
            return n_files * (self.num_experts + 1) - self.extra[rank_key]
        if metric == "freq":
            return self.freq.copy()
        if metric == "weighted_freq":
            return self.weighted_freq_sum.copy()
        num = self.reap_sum if metric == "reap" else self.ean_sum
        out = np.zeros_like(num)
        np.divide(num, self.reap_count, out=out, where=self.reap_count > 0)
        return out

    compute_scores = scores  # the seed's name

    @property
    def has_norms(self) -> bool:
        return bool(self.reap_count.sum() > 0)

    # ------------------------------------------------------------------ identity
    def identity(self) -> dict:
        return {key: getattr(self, key) for key in IDENTITY_KEYS}

    def check_matches(self, adapter, source: str | None = None) -> list[str]:
        """Raise a ``UserError`` unless these statistics were collected on ``adapter``'s model: model_type, top_k,
        MoE layer indices and expert count must all agree. Returns warnings (a file without model_type / top_k,
        written by another tool, is checked on what it has). Messages name ``source`` (default :attr:`source`)."""
        source = source or self.source
        want = {"model_type": adapter.model_type, "top_k": adapter.top_k, "num_layers": len(adapter.moe_layers()),
                "num_experts": adapter.num_experts, "moe_layer_indices": adapter.moe_layers()}
        for key, value in want.items():
            have = getattr(self, key)
            if have != value and not _unknown(key, have):
                raise UserError(
                    f"{source} does not match the model: {key} is {have} in the file but {value} in the model "
                    f"({adapter.model_type}); re-run `mlx-fun collect` on this model."
                )
        missing = [key for key in ("model_type", "top_k") if _unknown(key, getattr(self, key))]
        if missing:
            return [f"{source} records no {' or '.join(missing)} (written by another tool?); only its shape and "
                    f"layer indices could be checked against the model."]
        return []

    def check_provenance(self, model_dir, source: str | None = None) -> list[str]:
        """A one-line warning when these statistics were collected on a model whose weights fingerprint is not
        ``model_dir``'s (a base model's file read for its fine-tune: legitimate, but worth a look); nothing when it
        matches or the file records none (:func:`mlx_fun.observe.provenance.mismatch`)."""
        from .provenance import mismatch

        line = mismatch(self.provenance, model_dir, source or self.source)
        return [] if line is None else [line]

    # ------------------------------------------------------------------ I/O
    def to_arrays(self) -> dict[str, np.ndarray]:
        out = {key: getattr(self, key) for key in ARRAY_KEYS}
        out.update(self.extra)
        out.update(
            model_type=np.array(self.model_type),
            num_layers=np.array(self.num_layers),
            num_experts=np.array(self.num_experts),
            moe_layer_indices=np.array(self.moe_layer_indices, dtype=np.int64),
            top_k=np.array(self.top_k),
            total_tokens=np.array(self.total_tokens, dtype=np.int64),
            format_version=np.array(FORMAT_VERSION),
        )
        out.update({key: np.array(str(value)) for key, value in self.provenance.items()})
        if self.adapter is not None:
            out["adapter"] = np.array(json.dumps(self.adapter, sort_keys=True))
        return out

    def write_npz(self, path: str | os.PathLike) -> None:
        """Write the ``.npz`` to ``path`` as it is (a reservation's temp file; :meth:`save` reserves one)."""
        np.savez(path, **self.to_arrays())

    def save(self, path: str | os.PathLike, *, inputs: dict | None = None, force: bool = False) -> Path:
        """Write an ``.npz`` atomically through :func:`mlx_fun.core.writer.output` (an existing file only with ``force``)."""
        from ..core.writer import output

        with output(path, kind="file", suffix=".npz", inputs=inputs, force=force) as res:
            self.write_npz(res.tmp)
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike, *, name: str | None = None) -> "SaliencyAccumulator":
        """Read a saliency ``.npz`` and check all of it (:func:`_read_npz`, :func:`_check_arrays`): every bad
        file is one ``UserError``. ``name`` is the job parameter that gave ``path``; messages name it."""
        path = Path(path)
        label = f"{param(name)} {path}" if name else f"saliency file {path}"
        data = _read_npz(path, label)
        L, E = _check_arrays(data, label)
        try:
            acc = cls(
                L,
                E,
                model_type=str(data.get("model_type", "unknown")),
                moe_layer_indices=[int(i) for i in data["moe_layer_indices"]] if "moe_layer_indices" in data else None,
                top_k=int(data.get("top_k", 0)),
            )
            acc.total_tokens = int(data.get("total_tokens", 0))
        except (TypeError, ValueError) as e:
            raise UserError(f"{label}: its model_type / top_k / moe_layer_indices / total_tokens are not what "
                            f"`mlx-fun collect` writes ({e}); re-run `mlx-fun collect`.") from None
        if len(acc.moe_layer_indices) != L:
            raise UserError(f"{label}: moe_layer_indices lists {len(acc.moe_layer_indices)} layers but its arrays "
                            f"have {L} rows; the file is damaged: re-run `mlx-fun collect`.")
        for key in ARRAY_KEYS:
            if key in data:
                setattr(acc, key, data[key])
        acc.extra = {k: v for k, v in data.items() if k.startswith("rank_")}
        acc.adapter = _adapter(data.get("adapter"))
        acc.source, acc.missing = label, [key for key in ARRAY_KEYS if key not in data]
        acc.provenance = _provenance(data, label)
        return acc

    # ------------------------------------------------------------------ ranking
    def ranking_scores(self, metric: str, *, over: str = "experts") -> np.ndarray:
        """:meth:`scores` of ``metric`` for ranking ``over`` one of :data:`RANKINGS`; a ``UserError`` when they rank
        nothing (every expert of a layer, every column sum or every layer sum tied: all 0 after ``stats-purge``,
        reap / ean of a frequency-only file, freq's equal layer totals), naming the metrics this file can rank by."""
        scores = self.scores(metric)
        tie = self._tie(scores, over)
        if tie is None:
            return scores
        usable = [m for m in METRICS if m != metric and self._tie(self.scores(m), over) is None]
        fix = (f"this file can rank by {' or '.join(usable)}: pass {param('metric')} {usable[0]}" if usable else
               "no metric of this file can: re-run `mlx-fun collect` (or `stats-purge` with lower thresholds)")
        raise UserError(f"{self.source} cannot rank {'layers' if over == 'layers' else 'experts'} by "
                        f"{param('metric')} {metric}: {tie}{self._why_empty(metric)}; {fix}.")

    def _why_empty(self, metric: str) -> str:
        """Why ``metric`` may carry nothing in this file: an array it needs is missing, or there are no norms."""
        if f"rank_sum_{metric}" in self.extra:
            return ""
        if needs := [key for key in _NEEDS[metric] if key in self.missing]:
            return f" (the file has no {' or '.join(repr(key) for key in needs)} array)"
        if metric in ("reap", "ean") and not self.has_norms:
            return " (the file has no output norms: reap_count is 0 everywhere, collected frequency-only)"
        return ""

    def _tie(self, scores: np.ndarray, over: str) -> str | None:
        """Where ``scores`` tie completely for ranking ``over`` (see :meth:`ranking_scores`), in words; else None."""
        if over not in RANKINGS:
            raise ValueError(f"over must be one of {RANKINGS}, got {over!r}")
        rows = {"experts": scores, "columns": scores.sum(axis=0, keepdims=True),
                "layers": scores.sum(axis=1)[None, :]}[over]
        for pos, row in enumerate(rows):
            if np.ptp(row) <= 1e-9 * np.abs(row).max():  # equal up to rounding (all 0 included)
                value = f"{float(row[0]):.6g}"
                if over == "experts":
                    return f"every expert of layer {self.moe_layer_indices[pos]} scores {value}"
                if over == "columns":
                    return f"every expert's score summed over the layers is {value}"
                return f"every MoE layer's experts sum to {value}"
        return None


def _adapter(value) -> dict | None:
    """The ``adapter`` record of a saliency file (a JSON object as text; :func:`mlx_fun.model.lora.describe`), None
    when the file has none or one that is not such a record."""
    if value is None or value.shape != () or value.dtype.kind != "U":
        return None
    try:
        parsed = json.loads(str(value))
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _read_npz(path: Path, label: str) -> dict[str, np.ndarray]:
    """The arrays of the ``.npz`` at ``path``; a ``UserError`` (naming ``label``) for a missing path, a directory, a
    file that is not an ``.npz`` or one without ``freq``."""
    if not path.exists():
        raise UserError(f"{label} does not exist; create it with `mlx-fun collect`.")
    if path.is_dir():
        raise UserError(f"{label} is a directory, not a saliency file; pass the .npz that `mlx-fun collect` wrote.")
    if not path.is_file():
        raise UserError(f"{label} is not a regular file; pass the .npz that `mlx-fun collect` wrote.")
    try:
        data = dict(np.load(path, allow_pickle=False))
    except Exception as e:  # zipfile/ValueError/OSError: not an npz
        raise UserError(f"{label} is not a readable .npz saliency file ({type(e).__name__}: {e}).") from None
    if "freq" not in data:
        raise UserError(f"{label} has no 'freq' array; it is not a saliency file written by `mlx-fun collect`.")
    return data


def _provenance(data: dict[str, np.ndarray], label: str) -> dict[str, str]:
    """The provenance fields the file records (:data:`mlx_fun.observe.provenance.FIELDS`), each one text."""
    from .provenance import FIELDS

    out = {}
    for key in FIELDS:
        if key not in data:
            continue
        value = data[key]
        if value.shape != () or value.dtype.kind != "U":
            raise UserError(f"{label}: '{key}' is not a text (it names where the statistics came from); the file is "
                            "damaged: re-run `mlx-fun collect`.")
        out[key] = str(value)
    return out


def _check_arrays(data: dict[str, np.ndarray], label: str) -> tuple[int, int]:
    """The one validator of a saliency file's arrays: all :data:`ARRAY_KEYS` (turned into float64 in ``data``) and
    ``rank_sum_*`` share one (num_layers, num_experts) shape, hold finite numbers, and :data:`NON_NEGATIVE` ones
    no negative value. Returns that shape."""
    keys = [k for k in (*ARRAY_KEYS, *sorted(k for k in data if k.startswith("rank_sum_"))) if k in data]
    for key in keys:
        if data[key].dtype.kind not in "biuf":
            raise UserError(f"{label}: '{key}' holds {data[key].dtype} values, not numbers; re-run `mlx-fun collect`.")
        data[key] = np.asarray(data[key], dtype=np.float64)
    shape = _expected_shape(data, keys, label)
    for key in keys:
        arr = data[key]
        bad = ~np.isfinite(arr) | ((arr < 0) if key in NON_NEGATIVE else False)
        if bad.any():
            pos = tuple(int(i) for i in np.argwhere(bad)[0])
            rule = "finite and not negative" if key in NON_NEGATIVE else "finite"
            raise UserError(f"{label}: '{key}' is {arr[pos]} at MoE layer position {pos[0]}, expert {pos[1]} "
                            f"({int(bad.sum())} such entries), but must be {rule}; the file is damaged: re-run "
                            "`mlx-fun collect`.")
    if "rank_files" in data:
        n = data["rank_files"]
        if n.shape != () or n.dtype.kind not in "biuf" or not np.isfinite(n) or n < 1:
            raise UserError(f"{label}: 'rank_files' is {n}, not a file count of 1 or more; re-run "
                            "`mlx-fun stats-merge`.")
    _check_counts(data, label, shape[1])
    return shape


def _check_counts(data: dict[str, np.ndarray], label: str, num_experts: int) -> None:
    """The file's numbers outside its arrays, each in its range: ``total_tokens`` a whole number >= 0, ``top_k``
    0 (unknown) .. ``num_experts``, ``moe_layer_indices`` distinct decoder indices >= 0."""
    def whole(key: str, lo: int, hi: float = float("inf"), *, shape=()) -> None:
        if key not in data:
            return
        arr = np.asarray(data[key])
        ok = arr.shape == shape if shape is not None else arr.ndim == 1
        if ok and arr.dtype.kind in "biuf" and arr.size:
            as_float = arr.astype(np.float64)
            ok = bool(np.isfinite(as_float).all() and (as_float == np.round(as_float)).all()
                      and (as_float >= lo).all() and (as_float <= hi).all())
        elif ok:
            ok = arr.size == 0 and shape is None
        if not ok:
            shown = np.array2string(arr, threshold=6) if arr.dtype.kind in "biuf" else repr(arr.tolist())[:40]
            bound = f"{lo}..{hi}" if hi != float("inf") else f"{lo} or more"
            raise UserError(f"{label}: '{key}' is {shown}, but must be whole number(s) of {bound}; the file is "
                            "damaged: re-run `mlx-fun collect`.")

    whole("total_tokens", 0)
    whole("top_k", 0, num_experts)
    whole("moe_layer_indices", 0, shape=None)
    if "moe_layer_indices" in data and len(set(np.asarray(data["moe_layer_indices"]).tolist())) != np.size(
            data["moe_layer_indices"]):
        raise UserError(f"{label}: 'moe_layer_indices' lists a layer twice; the file is damaged: re-run "
                        "`mlx-fun collect`.")


def _expected_shape(data: dict[str, np.ndarray], keys: list[str], label: str) -> tuple[int, int]:
    """The (num_layers, num_experts) the file records (else the shape most of its arrays have, ``freq``'s on a
    tie); a ``UserError`` naming the array whose shape differs and what agrees on the expected one."""
    shapes = {key: data[key].shape for key in keys}
    recorded = None
    if "num_layers" in data and "num_experts" in data:
        try:
            recorded = (int(data["num_layers"]), int(data["num_experts"]))
        except (TypeError, ValueError):
            raise UserError(f"{label}: num_layers / num_experts are not integers; re-run `mlx-fun collect`.") from None
    want = recorded or Counter(shapes.values()).most_common(1)[0][0]
    if len(want) != 2 or min(want) < 1:
        raise UserError(f"{label}: 'freq' has shape {shapes['freq']}, expected (num_layers, num_experts), both at "
                        "least 1; re-run `mlx-fun collect`.")
    bad = [key for key, shape in shapes.items() if shape != want]
    if bad:
        agree = [f"'{key}'" for key, shape in shapes.items() if shape == want]
        agree += ["its num_layers / num_experts"] if recorded else []
        raise UserError(f"{label}: '{bad[0]}' has shape {shapes[bad[0]]}, but {', '.join(agree)} say {want}; the file "
                        "is damaged or not from `mlx-fun collect`: re-run `mlx-fun collect`.")
    return want


def _unknown(key: str, value) -> bool:
    """A file written without this identity key (another tool's format): ``model_type`` unknown, ``top_k`` 0."""
    return (key == "model_type" and value == "unknown") or (key == "top_k" and value == 0)


def check_same_model(accs, labels=None) -> None:
    """Raise a ``UserError`` naming the first identity mismatch (:data:`IDENTITY_KEYS`) between ``accs[0]`` and
    the others; ``labels`` name them in the message (file paths in the CLI). A key a file does not record
    (model_type ``unknown``, top_k 0) matches anything."""
    labels = list(labels) if labels is not None else [f"file {i + 1}" for i in range(len(accs))]
    first = accs[0].identity()
    for acc, label in zip(accs[1:], labels[1:]):
        other = acc.identity()
        for key in IDENTITY_KEYS:
            a, b = first[key], other[key]
            if a != b and not (_unknown(key, a) or _unknown(key, b)):
                raise UserError(
                    f"{labels[0]} and {label} do not match: {key} is {a} in {labels[0]} but {b} in {label}; "
                    "only statistics of the same model can be compared or combined."
                )
