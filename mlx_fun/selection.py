"""Which experts to KEEP in every MoE layer: prune strategies, constraints, expert lists and report sets.

Everything here is pure numpy and works on saliency scores of shape ``(num_moe_layers, num_experts)``
(higher = more important, see :mod:`mlx_fun.saliency`). Layers are addressed by their **position** among the
MoE layers (0 .. L-1); files written for users (expert lists, reports) use **decoder-layer indices** (the
entries of ``moe_layer_indices``) instead, and the loaders convert.

The result of every selection is a *kept map*: ``{layer position: sorted list of kept expert indices}``.

Strategies (per layer, or on column sums with ``model_wide``)
---------------------------------------------------------------
``bottom``
    Remove the ``n`` experts with the lowest saliency.
``strided``
    Sort experts by saliency, most important first. The top ``E - n`` form the *important* group, the bottom
    ``n`` the *unimportant* group. Half of the removals, ``n // 2``, come from the important group, the other
    ``n - n // 2`` from the unimportant group: an odd ``n`` takes its extra removal from the unimportant
    group. The important group never loses more than half of its members: it gives
    ``min(n // 2, (E - n) // 2)`` and the unimportant group the rest, which only differs from the 50/50 split
    when more than about half of the experts are pruned. Within a group of ``G`` experts (in sorted order, most
    important first) from which ``r`` are removed, the removed positions are
    ``floor((i + 1) * G / r) - 1`` for ``i = 0 .. r-1``; with an integer stride ``s = G / r`` these are
    ``s-1, 2s-1, ..., G-1`` — "every s-th expert", the last one always being the group's least important.
    The seed's example, 160 experts and ``n = 40``: important = ranks 0..119 (stride 120/20 = 6, removes
    ranks 5, 11, ..., 119), unimportant = ranks 120..159 (stride 40/20 = 2, removes ranks 121, 123, ..., 159);
    40 removed, 120 kept. ``n = 1`` removes the least important expert, like ``bottom``.

Ties in saliency: the lower expert index counts as the more important one (both strategies).

Constraints (:func:`select_experts`)
------------------------------------
- ``0 <= n_prune < E``; ``n_prune = 0`` keeps everything.
- At least ``top_k`` experts stay in every layer; exactly ``top_k`` is allowed, and
  :func:`check_keep_counts` returns a warning for it (the CLI prints it).
- ``min_experts_per_layer`` (default 1): at least that many stay in every layer.
- ``protected`` experts are never removed ("score +inf"); ``targeted`` experts are removed first ("score
  -inf"): when there are at most ``n`` targeted experts in a layer all of them go and the strategy picks the
  rest among the unprotected, untargeted experts; when there are more, only targeted experts go (the ``n``
  least salient of them). An expert both protected and targeted is protected (protection wins). The strategy
  works on the removable pool only: protected and targeted experts are taken out before ranking.
- ``model_wide``: scores are summed over layers (column sums) and the same ``n`` expert indices are removed
  from every layer. An index protected in any layer, or listed in ``ignore_experts``, is never removed; an
  index targeted in any layer (and protected in none) is targeted. ``ignore_experts`` is only valid here.
- Groups (``n_group > 1``, DeepSeek-style group-limited routing; group ``g`` holds experts
  ``g*E/n_group .. (g+1)*E/n_group - 1``): the same number ``n / n_group`` is removed from every group
  (``n`` must be a multiple of ``n_group``), each chosen inside its group by the strategy (on column sums per
  group with ``model_wide``); every group keeps at least 2 experts (a group is scored by its top-2 experts),
  and the ``topk_group`` best groups together must still hold ``top_k`` experts.

Expert list (``mlx-fun prune --expert-list``, exported by the UI as ``filtered_experts.json`` / ``.csv``)
--------------------------------------------------------------------------------------------------------
JSON::

    {
      "format": "mlx-fun-expert-list",      # required, exactly this string
      "version": 1,                          # optional, default 1; only 1 is understood
      "mode": "prune",                       # optional: "prune" or "merge"; informational
      "model_type": "qwen3_moe",             # optional; informational
      "num_experts": 64,                     # optional; when present it must equal the model's expert count
      "layers": {                            # required; keys are DECODER-LAYER indices, as strings
        "0": {"remove": [3, 17, 42]},        # either the experts to remove ...
        "1": {"keep": [0, 1, 2, 5]}          # ... or the experts to keep: exactly one of the two per layer
      }
    }

Each layer entry is an object with exactly one key, ``"remove"`` or ``"keep"``, whose value is a list of
distinct integer expert indices in ``0 .. num_experts-1``. Layer keys must be MoE layers of the model and
appear once. MoE layers absent from ``"layers"`` keep all their experts.

CSV (UTF-8; a header line, then one row per expert; blank lines and lines starting with ``#`` are ignored)::

    layer,expert,action
    0,3,remove
    0,17,remove
    1,0,keep

``layer`` is the decoder-layer index, ``expert`` the expert index, ``action`` is ``remove`` or ``keep``
(case-insensitive). All rows of one layer must have the same action; a ``(layer, expert)`` pair may appear
once. Layers without rows keep all their experts. Errors name the file and, for CSV, the line number.

mlx-lm models hold one expert count for all layers, so a pruned model must keep the same number of experts in
every MoE layer: :func:`check_keep_counts` (which the CLI runs on every kept map) rejects lists that do not —
in practice an expert list names every MoE layer, removing the same number from each.

Report schemas read by :func:`load_report_experts` (the minimum; other keys are ignored)
------------------------------------------------------------------------------------------
``safety_report.json`` (``mlx-fun safety-scan``)::

    {"safety_critical": {"<decoder layer>": [experts...]},   # used when present
     "hcdg": {"<decoder layer>": [...]}, "hrcg": {"<decoder layer>": [...]}}   # else the union of these two

``domain_report.json`` (``mlx-fun domain-scan``)::

    {"domain_experts": {"<decoder layer>": [experts...]}}

Sets from several reports (e.g. safety protect + domain protect) merge by union (:func:`merge_expert_sets`).
"""

from __future__ import annotations

import csv
import io as _io
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from .errors import UserError

STRATEGIES = ("bottom", "strided")
EXPERT_LIST_FORMAT = "mlx-fun-expert-list"
EXPERT_LIST_VERSION = 1
EXPERT_LIST_MODES = ("prune", "merge")
CSV_HEADER = ("layer", "expert", "action")

KeptMap = dict[int, list[int]]
ExpertSets = dict[int, set[int]]


# ---------------------------------------------------------------------------------------------- small helpers
def _fmt_ints(values: Iterable[int], limit: int = 12) -> str:
    """``1, 2, 5..9`` style listing (runs of 3+ collapsed), cut after ``limit`` items."""
    vals = sorted(set(int(v) for v in values))
    parts: list[str] = []
    i = 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{vals[i]}..{vals[j]}")
        else:
            parts.extend(str(v) for v in vals[i : j + 1])
        i = j + 1
    if len(parts) > limit:
        parts = parts[: limit - 1] + ["...", parts[-1]]
    return ", ".join(parts) if parts else "(none)"


def _fmt_multiples(values: list[int]) -> str:
    if len(values) <= 12:
        return ", ".join(str(v) for v in values)
    return ", ".join(str(v) for v in values[:5]) + ", ..., " + ", ".join(str(v) for v in values[-2:])


def _layer_name(pos: int, moe_layer_indices: list[int] | None) -> str:
    if moe_layer_indices is not None and 0 <= pos < len(moe_layer_indices):
        return f"layer {moe_layer_indices[pos]}"
    return f"MoE layer #{pos}"


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


# ---------------------------------------------------------------------------------------------- range parsing
def parse_expert_ranges(text: str, num_experts: int | None = None, option: str = "--ignore-experts") -> list[int]:
    """Parse ``"1,2,250..255"`` (inclusive ``a..b`` ranges, whitespace allowed) into a sorted, unique list.

    Raises ``UserError`` naming the bad token for empty entries, non-integers, negative numbers, reversed
    ranges and (when ``num_experts`` is given) indices ``>= num_experts``.
    """
    if text is None or not str(text).strip():
        raise UserError(f"{option} is empty; give expert indices like 1,2,250..255.")
    out: set[int] = set()
    for raw in str(text).split(","):
        tok = raw.strip()
        if not tok:
            raise UserError(f"{option} '{text}' has an empty entry; separate indices with single commas, e.g. 1,2,250..255.")
        if ".." in tok:
            a, _, b = tok.partition("..")
            a, b = a.strip(), b.strip()
            if not (a.isdigit() and b.isdigit()):
                raise UserError(
                    f"{option}: '{tok}' is not a range; write ranges as START..END with non-negative integers, e.g. 250..255."
                )
            lo, hi = int(a), int(b)
            if lo > hi:
                raise UserError(f"{option}: range '{tok}' is reversed; write it as {hi}..{lo}.")
            vals = range(lo, hi + 1)
        else:
            if not tok.isdigit():
                raise UserError(
                    f"{option}: '{tok}' is not a non-negative integer; use indices and START..END ranges, e.g. 1,2,250..255."
                )
            vals = range(int(tok), int(tok) + 1)
        if num_experts is not None and vals and vals[-1] >= num_experts:
            raise UserError(
                f"{option}: '{tok}' is out of range; the model has {num_experts} experts (0..{num_experts - 1})."
            )
        out.update(vals)
    return sorted(out)


# ---------------------------------------------------------------------------------------------- strategies
def _removal_order(scores: np.ndarray) -> np.ndarray:
    """Indices from least to most important (ties: the higher index counts as less important)."""
    scores = np.asarray(scores, dtype=np.float64)
    idx = np.arange(scores.shape[0])
    return np.lexsort((-idx, scores))


def _stride_positions(group_size: int, n_remove: int) -> np.ndarray:
    """Positions ``floor((i+1)*G/r) - 1``: every (G/r)-th member, ending on the last one."""
    if n_remove <= 0:
        return np.zeros(0, dtype=np.int64)
    i = np.arange(1, n_remove + 1, dtype=np.int64)
    return (i * group_size) // n_remove - 1


def _bottom_removed(scores: np.ndarray, n: int) -> np.ndarray:
    return _removal_order(scores)[:n]


def _strided_removed(scores: np.ndarray, n: int) -> np.ndarray:
    E = len(scores)
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    desc = _removal_order(scores)[::-1]  # most important first
    n_important = min(n // 2, (E - n) // 2)  # the important group loses at most half
    n_unimportant = n - n_important
    important, unimportant = desc[: E - n], desc[E - n :]
    return np.concatenate(
        [important[_stride_positions(E - n, n_important)], unimportant[_stride_positions(n, n_unimportant)]]
    )


_REMOVERS = {"bottom": _bottom_removed, "strided": _strided_removed}


def _check_row(scores_row, n_prune: int) -> np.ndarray:
    row = np.asarray(scores_row, dtype=np.float64)
    if row.ndim != 1:
        raise ValueError(f"scores_row must be 1-D, got shape {row.shape}")
    if not (_is_int(n_prune) and 0 <= n_prune < len(row)):
        raise UserError(f"--n-prune {n_prune} must be between 0 and {len(row) - 1} (the layer has {len(row)} experts).")
    return row


def select_bottom(scores_row, n_prune: int) -> list[int]:
    """Kept expert indices (sorted) after removing the ``n_prune`` lowest-scoring experts."""
    row = _check_row(scores_row, n_prune)
    return sorted(set(range(len(row))) - set(_bottom_removed(row, n_prune).tolist()))


def select_strided(scores_row, n_prune: int) -> list[int]:
    """Kept expert indices (sorted) after strided removal (see the module docstring)."""
    row = _check_row(scores_row, n_prune)
    return sorted(set(range(len(row))) - set(_strided_removed(row, n_prune).tolist()))


def _choose(scores: np.ndarray, n: int, strategy: str, protected: np.ndarray, targeted: np.ndarray) -> np.ndarray:
    """Indices (into ``scores``) of the ``n`` experts to remove; the caller has checked there are enough removable."""
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    targeted = targeted & ~protected
    t_idx = np.flatnonzero(targeted)
    if len(t_idx) >= n:
        return t_idx[_removal_order(scores[t_idx])[:n]]
    f_idx = np.flatnonzero(~protected & ~targeted)
    rest = n - len(t_idx)
    assert rest <= len(f_idx)
    return np.concatenate([t_idx, f_idx[_REMOVERS[strategy](scores[f_idx], rest)]])


# ---------------------------------------------------------------------------------------------- select_experts
def _to_masks(sets, L: int, E: int, what: str) -> np.ndarray:
    """(L, E) boolean mask from a per-layer dict {position: experts}, a global set, or None."""
    mask = np.zeros((L, E), dtype=bool)
    if sets is None:
        return mask
    if isinstance(sets, Mapping):
        items = sets.items()
    else:
        items = [(None, sets)]
    for pos, experts in items:
        if pos is not None and not (_is_int(pos) and 0 <= pos < L):
            raise UserError(f"{what} experts name MoE layer #{pos}, but the model has {L} MoE layers.")
        for e in experts:
            if not (_is_int(e) and 0 <= e < E):
                raise UserError(f"{what} expert {e!r} is out of range; the model has {E} experts (0..{E - 1}).")
            if pos is None:
                mask[:, int(e)] = True
            else:
                mask[int(pos), int(e)] = True
    return mask


def _valid_group_values(E: int, n_group: int, topk_group: int | None, top_k: int, min_keep: int) -> list[int]:
    gs = E // n_group
    out = []
    for m in range(0, gs - 1):  # keep >= 2 per group
        n = m * n_group
        keep = E - n
        if keep < top_k or keep < min_keep:
            continue
        if topk_group and topk_group * (gs - m) < top_k:
            continue
        out.append(n)
    return out


def select_experts(
    scores,
    n_prune: int,
    *,
    top_k: int,
    strategy: str = "bottom",
    model_wide: bool = False,
    min_experts_per_layer: int = 1,
    ignore_experts: Iterable[int] | None = None,
    protected: Mapping[int, Iterable[int]] | Iterable[int] | None = None,
    targeted: Mapping[int, Iterable[int]] | Iterable[int] | None = None,
    groups: tuple[int, int | None] | None = None,
    moe_layer_indices: list[int] | None = None,
) -> KeptMap:
    """Choose the experts to keep in every MoE layer; returns ``{layer position: sorted kept indices}``.

    ``scores`` is (L, E), higher = more important. ``protected`` / ``targeted`` are either per-layer dicts keyed
    by layer position or one set applied to every layer. ``groups`` is ``(n_group, topk_group)`` of
    group-limited routers (``None`` or ``n_group <= 1``: no groups). ``moe_layer_indices`` only names layers in
    messages. Every violated constraint raises ``UserError`` (see the module docstring); call
    :func:`check_keep_counts` on the result for the "exactly top_k" warning.
    """
    S = np.asarray(scores, dtype=np.float64)
    if S.ndim != 2:
        raise UserError(f"saliency scores must be (num_layers, num_experts), got shape {S.shape}.")
    L, E = S.shape
    if np.isnan(S).any():
        raise UserError("the saliency scores contain NaN; re-run `mlx-fun collect` (or check the merged stats file).")
    if strategy not in STRATEGIES:
        raise UserError(f"unknown --strategy '{strategy}'; choose one of {', '.join(STRATEGIES)}.")
    if not _is_int(top_k) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    if not _is_int(n_prune):
        raise UserError(f"--n-prune must be an integer, got {n_prune!r}.")
    n_prune = int(n_prune)
    if n_prune < 0 or n_prune >= E:
        raise UserError(f"--n-prune {n_prune} is out of range: the model has {E} experts per layer; use 0..{E - top_k}.")
    ignore = sorted(set(int(e) for e in ignore_experts)) if ignore_experts is not None else []
    if ignore and not model_wide:
        raise UserError("--ignore-experts only works with --model-wide; add --model-wide or drop --ignore-experts.")
    for e in ignore:
        if not 0 <= e < E:
            raise UserError(f"--ignore-experts: expert {e} is out of range; the model has {E} experts (0..{E - 1}).")
    if not _is_int(min_experts_per_layer) or min_experts_per_layer < 1:
        raise UserError(f"--min-experts-per-layer must be at least 1, got {min_experts_per_layer}.")

    keep = E - n_prune
    if keep < top_k:
        raise UserError(
            f"--n-prune {n_prune} would keep {keep} experts but top_k is {top_k}; prune at most {E - top_k}."
        )
    if keep < min_experts_per_layer:
        raise UserError(
            f"--n-prune {n_prune} would keep {keep} experts per layer but --min-experts-per-layer is "
            f"{min_experts_per_layer}; prune at most {E - min_experts_per_layer}."
        )

    # groups
    n_group, topk_group = (1, None) if groups is None else (int(groups[0] or 1), groups[1])
    if n_group > 1:
        if E % n_group:
            raise UserError(f"the model has {E} experts, not divisible by n_group={n_group}; its config is inconsistent.")
        gs = E // n_group
        valid = _valid_group_values(E, n_group, topk_group, top_k, min_experts_per_layer)
        hint = f"valid values: {_fmt_multiples(valid)}" if valid else "no value but 0 is valid"
        if n_prune % n_group:
            raise UserError(
                f"--n-prune {n_prune} is not a multiple of n_group={n_group}: group-limited routing needs the same "
                f"number of experts removed from each of the {n_group} groups; {hint}."
            )
        per_group = n_prune // n_group
        if gs - per_group < 2:
            raise UserError(
                f"--n-prune {n_prune} would leave {gs - per_group} expert(s) in each of the {n_group} groups, but each "
                f"group needs at least 2 (groups are scored by their top-2 experts); prune at most {n_group * (gs - 2)}."
            )
        if topk_group and topk_group * (gs - per_group) < top_k:
            raise UserError(
                f"--n-prune {n_prune} would leave {gs - per_group} experts per group, so the topk_group={topk_group} "
                f"selected groups hold only {topk_group * (gs - per_group)} experts but top_k is {top_k}; {hint}."
            )
    else:
        n_group, gs, per_group = 1, E, n_prune
    group_slices = [slice(g * gs, (g + 1) * gs) for g in range(n_group)]

    prot = _to_masks(protected, L, E, "protected")
    targ = _to_masks(targeted, L, E, "targeted")
    if model_wide:
        rows = S.sum(axis=0, keepdims=True)
        prot = prot.any(axis=0, keepdims=True)
        if ignore:
            prot[0, ignore] = True
        targ = targ.any(axis=0, keepdims=True)
        names = ["all layers (--model-wide)"]
    else:
        rows = S
        names = [_layer_name(p, moe_layer_indices) for p in range(L)]

    # enough removable experts everywhere?
    removable = (~prot).reshape(prot.shape[0], n_group, gs).sum(axis=2)  # (rows, groups)
    worst_row, worst_group = np.unravel_index(np.argmin(removable), removable.shape)
    least = int(removable[worst_row, worst_group])
    if least < per_group:
        where = names[worst_row] + (f", group {worst_group}" if n_group > 1 else "")
        allowed = least * n_group
        raise UserError(
            f"protected experts leave only {least} removable expert(s) in {where}"
            + (f" (the same number must go from each of the {n_group} groups)" if n_group > 1 else "")
            + f"; --n-prune {n_prune} is too many: prune at most {allowed}, or protect fewer experts."
        )

    removed_rows: list[set[int]] = []
    for r in range(rows.shape[0]):
        removed: set[int] = set()
        for g, sl in enumerate(group_slices):
            local = _choose(rows[r, sl], per_group, strategy, prot[r, sl], targ[r, sl])
            removed.update(int(i) + g * gs for i in local)
        removed_rows.append(removed)

    if model_wide:
        kept = [e for e in range(E) if e not in removed_rows[0]]
        return {p: list(kept) for p in range(L)}
    return {p: [e for e in range(E) if e not in removed_rows[p]] for p in range(L)}


def check_keep_counts(
    kept: Mapping[int, Iterable[int]],
    num_experts: int,
    top_k: int,
    *,
    groups: tuple[int, int | None] | None = None,
    moe_layer_indices: list[int] | None = None,
    require_uniform: bool = True,
) -> list[str]:
    """Validate a kept map (from :func:`select_experts` or an expert list); return warnings to print.

    Raises ``UserError`` when a layer keeps fewer than ``top_k`` experts, keeps an index out of range or twice,
    breaks group balance (``groups=(n_group, topk_group)``, n_group > 1: same count per group, ≥ 2 each), or
    (``require_uniform``) when layers keep different numbers of experts (mlx-lm configs hold one expert count).
    Returns one warning when layers keep exactly ``top_k`` experts.
    """
    counts: dict[int, int] = {}
    for pos, experts in kept.items():
        ex = list(experts)
        name = _layer_name(pos, moe_layer_indices)
        if len(set(ex)) != len(ex):
            raise UserError(f"{name} keeps an expert twice ({sorted(ex)}); each expert may be kept once.")
        bad = [e for e in ex if not (_is_int(e) and 0 <= e < num_experts)]
        if bad:
            raise UserError(f"{name} keeps expert {bad[0]!r}, out of range 0..{num_experts - 1}.")
        if len(ex) < top_k:
            raise UserError(
                f"{name} would keep {len(ex)} experts but top_k is {top_k}; prune at most {num_experts - top_k}."
            )
        counts[pos] = len(ex)
        if groups is not None and groups[0] and groups[0] > 1:
            n_group, topk_group = int(groups[0]), groups[1]
            gs = num_experts // n_group
            per = np.bincount(np.asarray(ex, dtype=np.int64) // gs, minlength=n_group)
            if len(set(per.tolist())) != 1:
                raise UserError(
                    f"{name} keeps {per.tolist()} experts in its {n_group} groups; group-limited routing needs the "
                    "same number kept in every group: remove the same number of experts from each group."
                )
            if per[0] < 2:
                raise UserError(
                    f"{name} keeps {int(per[0])} expert(s) per group but each group needs at least 2 "
                    "(groups are scored by their top-2 experts); remove fewer experts."
                )
            if topk_group and topk_group * int(per[0]) < top_k:
                raise UserError(
                    f"{name} keeps {int(per[0])} experts per group, so the topk_group={topk_group} selected groups "
                    f"hold only {topk_group * int(per[0])} experts but top_k is {top_k}; remove fewer experts."
                )
    if require_uniform and len(set(counts.values())) > 1:
        lo = min(counts, key=lambda p: (counts[p], p))
        hi = max(counts, key=lambda p: (counts[p], -p))
        raise UserError(
            f"layers keep different numbers of experts ({_layer_name(lo, moe_layer_indices)}: {counts[lo]}, "
            f"{_layer_name(hi, moe_layer_indices)}: {counts[hi]}); an mlx-lm model has one expert count for all "
            "layers, so remove the same number of experts from every MoE layer."
        )
    exact = sorted(p for p, c in counts.items() if c == top_k)
    if exact:
        layers = (
            "every layer"
            if len(exact) == len(counts)
            else ", ".join(_layer_name(p, moe_layer_indices) for p in exact[:8]) + (" ..." if len(exact) > 8 else "")
        )
        return [
            f"{layers} keeps exactly top_k = {top_k} experts: every token will use every remaining expert, "
            "so routing no longer chooses; prune fewer experts to keep the MoE benefit."
        ]
    return []


def removed_from_kept(kept: Mapping[int, Iterable[int]], num_experts: int) -> dict[int, list[int]]:
    """``{position: sorted removed indices}`` of a kept map."""
    return {p: sorted(set(range(num_experts)) - set(int(e) for e in ex)) for p, ex in kept.items()}


# ---------------------------------------------------------------------------------------------- expert lists
def _moe_indices(num_layers: int, moe_layer_indices) -> list[int]:
    idx = list(range(num_layers)) if moe_layer_indices is None else [int(i) for i in moe_layer_indices]
    if len(idx) != num_layers:
        raise ValueError(f"moe_layer_indices has {len(idx)} entries but num_layers is {num_layers}")
    return idx


def _read_text(path: Path, what: str, fix: str) -> str:
    if not path.is_file():
        raise UserError(f"{what} {path} does not exist; {fix}")
    try:
        return path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{what} {path} cannot be read ({type(e).__name__}: {e}).") from None


def _no_dup_keys(path: Path):
    def hook(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise UserError(f"{path}: key '{k}' appears twice in one object; keep one of them.")
            seen.add(k)
        return dict(pairs)

    return hook


def _load_json(path: Path, what: str, fix: str):
    text = _read_text(path, what, fix)
    try:
        return json.loads(text, object_pairs_hook=_no_dup_keys(path))
    except json.JSONDecodeError as e:
        raise UserError(f"{what} {path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}).") from None


def _parse_layer_key(key, path: Path, moe_idx: list[int], where: str = "") -> int:
    """Decoder-layer index (str/int) → position; UserError naming the file when it is not an MoE layer."""
    k = str(key).strip()
    if not (k.isdigit() or (k.startswith("-") and k[1:].isdigit())):
        raise UserError(f"{path}{where}: layer '{key}' is not an integer decoder-layer index.")
    layer = int(k)
    if layer not in moe_idx:
        raise UserError(
            f"{path}{where}: layer {layer} is not an MoE layer of this model (MoE layers: {_fmt_ints(moe_idx)}); "
            "was the file made for another model?"
        )
    return moe_idx.index(layer)


def load_expert_list(
    path: str | os.PathLike,
    num_layers: int,
    num_experts: int,
    moe_layer_indices: list[int] | None = None,
) -> KeptMap:
    """Read an expert list (JSON or CSV, see the module docstring); return ``{position: sorted kept}``.

    The format follows the suffix (``.csv`` → CSV, ``.json`` → JSON; otherwise a file starting with ``{`` is
    JSON). Every MoE layer appears in the result; layers absent from the file keep all experts.
    """
    path = Path(path)
    moe_idx = _moe_indices(num_layers, moe_layer_indices)
    fix = "export it from the UI (filtered_experts.json/.csv) or write one (see `mlx-fun prune --help`)."
    text = _read_text(path, "expert list", fix)
    suffix = path.suffix.lower()
    is_csv = suffix == ".csv" or (suffix != ".json" and not text.lstrip().startswith("{"))
    if is_csv:
        spec = _parse_expert_csv(text, path, moe_idx, num_experts)
    else:
        spec = _parse_expert_json(path, moe_idx, num_experts)
    kept: KeptMap = {}
    for pos in range(num_layers):
        if pos not in spec:
            kept[pos] = list(range(num_experts))
            continue
        action, experts = spec[pos]
        kept[pos] = sorted(experts) if action == "keep" else sorted(set(range(num_experts)) - set(experts))
    return kept


def _parse_expert_json(path: Path, moe_idx: list[int], num_experts: int) -> dict[int, tuple[str, list[int]]]:
    data = _load_json(path, "expert list", "")
    if not isinstance(data, dict):
        raise UserError(f"{path}: an expert list must be a JSON object with \"format\" and \"layers\".")
    fmt = data.get("format")
    if fmt != EXPERT_LIST_FORMAT:
        raise UserError(
            f"{path}: \"format\" is {fmt!r}, expected \"{EXPERT_LIST_FORMAT}\"; is this an expert list exported by the UI?"
        )
    version = data.get("version", EXPERT_LIST_VERSION)
    if version != EXPERT_LIST_VERSION:
        raise UserError(f"{path}: expert-list version {version!r} is not supported; this mlx-fun reads version 1.")
    mode = data.get("mode", "prune")
    if mode not in EXPERT_LIST_MODES:
        raise UserError(f"{path}: \"mode\" is {mode!r}; use one of {', '.join(EXPERT_LIST_MODES)}.")
    if "num_experts" in data and data["num_experts"] != num_experts:
        raise UserError(
            f"{path} was made for a model with {data['num_experts']} experts per layer, but this model has "
            f"{num_experts}; export the list for this model."
        )
    layers = data.get("layers")
    if not isinstance(layers, dict):
        raise UserError(f"{path}: \"layers\" is missing or not an object mapping decoder-layer indices to {{\"remove\": [...]}}.")
    spec: dict[int, tuple[str, list[int]]] = {}
    for key, entry in layers.items():
        pos = _parse_layer_key(key, path, moe_idx)
        if pos in spec:
            raise UserError(f"{path}: layer {moe_idx[pos]} appears twice in \"layers\"; merge the two entries.")
        if not isinstance(entry, dict):
            raise UserError(f"{path}: layer {key} must be an object like {{\"remove\": [3, 17]}} or {{\"keep\": [...]}}.")
        actions = [a for a in ("remove", "keep") if a in entry]
        unknown = [k for k in entry if k not in ("remove", "keep")]
        if unknown:
            raise UserError(f"{path}: layer {key} has unknown key '{unknown[0]}'; use exactly one of \"remove\" or \"keep\".")
        if len(actions) != 1:
            raise UserError(
                f"{path}: layer {key} has {'both' if actions else 'neither of'} \"remove\" and \"keep\"; "
                "give exactly one of them per layer."
            )
        action = actions[0]
        experts = entry[action]
        if not isinstance(experts, list):
            raise UserError(f"{path}: layer {key} \"{action}\" must be a list of expert indices.")
        seen: set[int] = set()
        for e in experts:
            if not _is_int(e):
                raise UserError(f"{path}: layer {key} \"{action}\" has {e!r}, which is not an integer expert index.")
            if not 0 <= e < num_experts:
                raise UserError(
                    f"{path}: layer {key} \"{action}\" has expert {e}, out of range 0..{num_experts - 1} "
                    f"(the model has {num_experts} experts)."
                )
            if e in seen:
                raise UserError(f"{path}: layer {key} \"{action}\" lists expert {e} twice; list each expert once.")
            seen.add(int(e))
        spec[pos] = (action, sorted(seen))
    return spec


def _parse_expert_csv(text: str, path: Path, moe_idx: list[int], num_experts: int) -> dict[int, tuple[str, list[int]]]:
    reader = csv.reader(_io.StringIO(text))
    header_seen = False
    actions: dict[int, tuple[str, int]] = {}  # pos -> (action, first line)
    rows: dict[tuple[int, int], int] = {}  # (pos, expert) -> line
    experts: dict[int, list[int]] = {}
    for row in reader:
        line = reader.line_num
        cells = [c.strip() for c in row]
        if not cells or all(not c for c in cells) or cells[0].startswith("#"):
            continue
        if not header_seen:
            if tuple(c.lower() for c in cells) != CSV_HEADER:
                raise UserError(
                    f"{path}, line {line}: expected the header 'layer,expert,action', found '{','.join(row)}'."
                )
            header_seen = True
            continue
        if len(cells) != 3:
            raise UserError(f"{path}, line {line}: expected 3 fields (layer,expert,action), found {len(cells)}.")
        layer_s, expert_s, action = cells[0], cells[1], cells[2].lower()
        pos = _parse_layer_key(layer_s, path, moe_idx, where=f", line {line}")
        if not expert_s.isdigit():
            raise UserError(f"{path}, line {line}: expert '{expert_s}' is not a non-negative integer.")
        e = int(expert_s)
        if e >= num_experts:
            raise UserError(
                f"{path}, line {line}: expert {e} is out of range 0..{num_experts - 1} (the model has {num_experts} experts)."
            )
        if action not in ("remove", "keep"):
            raise UserError(f"{path}, line {line}: action '{cells[2]}' must be 'remove' or 'keep'.")
        if pos in actions and actions[pos][0] != action:
            prev, prev_line = actions[pos]
            raise UserError(
                f"{path}, line {line}: layer {moe_idx[pos]} mixes '{action}' with '{prev}' (line {prev_line}); "
                "use one action per layer."
            )
        actions.setdefault(pos, (action, line))
        if (pos, e) in rows:
            raise UserError(
                f"{path}, line {line}: expert {e} of layer {moe_idx[pos]} is listed twice (also on line {rows[(pos, e)]})."
            )
        rows[(pos, e)] = line
        experts.setdefault(pos, []).append(e)
    if not header_seen:
        raise UserError(f"{path}: the CSV is empty; it needs the header 'layer,expert,action' and one row per expert.")
    return {pos: (actions[pos][0], sorted(ex)) for pos, ex in experts.items()}


def save_expert_list(
    path: str | os.PathLike,
    kept: Mapping[int, Iterable[int]],
    *,
    num_experts: int,
    moe_layer_indices: list[int] | None = None,
    model_type: str | None = None,
    mode: str = "prune",
) -> Path:
    """Write a kept map as an expert list (``remove`` lists), atomically. ``.csv`` suffix → CSV, else JSON."""
    from .io import atomic_file, write_json

    path = Path(path)
    names = lambda p: int(moe_layer_indices[p]) if moe_layer_indices is not None else int(p)  # noqa: E731
    removed = removed_from_kept(kept, num_experts)
    if path.suffix.lower() == ".csv":
        buf = _io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(CSV_HEADER)
        for pos in sorted(removed):
            for e in removed[pos]:
                w.writerow([names(pos), e, "remove"])
        with atomic_file(path) as tmp:
            tmp.write_text(buf.getvalue(), encoding="utf-8")
        return path
    obj: dict = {"format": EXPERT_LIST_FORMAT, "version": EXPERT_LIST_VERSION, "mode": mode}
    if model_type is not None:
        obj["model_type"] = model_type
    obj["num_experts"] = int(num_experts)
    obj["layers"] = {str(names(pos)): {"remove": removed[pos]} for pos in sorted(removed)}
    write_json(path, obj)
    return path


# ---------------------------------------------------------------------------------------------- reports
def _read_layer_map(obj, key: str, path: Path, moe_idx: list[int], num_experts: int | None) -> ExpertSets:
    if not isinstance(obj, dict):
        raise UserError(f"{path}: \"{key}\" must be an object mapping decoder-layer indices to expert lists.")
    out: ExpertSets = {}
    for layer, experts in obj.items():
        pos = _parse_layer_key(layer, path, moe_idx, where=f" (\"{key}\")")
        if not isinstance(experts, list):
            raise UserError(f"{path}: \"{key}\" layer {layer} must be a list of expert indices.")
        for e in experts:
            if not _is_int(e) or e < 0 or (num_experts is not None and e >= num_experts):
                rng = f"0..{num_experts - 1}" if num_experts is not None else "non-negative integers"
                raise UserError(f"{path}: \"{key}\" layer {layer} has expert {e!r}, expected {rng}.")
        out.setdefault(pos, set()).update(int(e) for e in experts)
    return out


def load_report_experts(
    path: str | os.PathLike,
    kind: str = "safety",
    moe_layer_indices: list[int] | None = None,
    num_experts: int | None = None,
) -> ExpertSets:
    """Expert sets of a ``safety_report.json`` / ``domain_report.json``: ``{layer position: {experts}}``.

    safety: ``safety_critical``, else the union of ``hcdg`` and ``hrcg``; domain: ``domain_experts``. Layer keys
    are decoder-layer indices, converted to positions with ``moe_layer_indices`` (``None``: keys are positions).
    """
    path = Path(path)
    if kind not in ("safety", "domain"):
        raise ValueError(f"kind must be 'safety' or 'domain', got {kind!r}")
    scan = "safety-scan" if kind == "safety" else "domain-scan"
    data = _load_json(path, f"{kind} report", f"create it with `mlx-fun {scan}`.")
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a {kind} report (expected a JSON object); create it with `mlx-fun {scan}`.")
    if moe_layer_indices is None:
        keys = []
        for k in ("safety_critical", "hcdg", "hrcg", "domain_experts"):
            if isinstance(data.get(k), dict):
                keys += [int(x) for x in data[k] if str(x).strip().lstrip("-").isdigit()]
        moe_idx = list(range(max(keys, default=-1) + 1))
    else:
        moe_idx = [int(i) for i in moe_layer_indices]
    if kind == "safety":
        if "safety_critical" in data:
            return _read_layer_map(data["safety_critical"], "safety_critical", path, moe_idx, num_experts)
        if "hcdg" in data or "hrcg" in data:
            parts = [
                _read_layer_map(data[k], k, path, moe_idx, num_experts) for k in ("hcdg", "hrcg") if k in data
            ]
            return merge_expert_sets(*parts)
        raise UserError(
            f"{path} has no \"safety_critical\" (nor \"hcdg\"/\"hrcg\") map; pass a safety_report.json written by "
            "`mlx-fun safety-scan`."
        )
    if "domain_experts" not in data:
        raise UserError(
            f"{path} has no \"domain_experts\" map; pass a domain_report.json written by `mlx-fun domain-scan`."
        )
    return _read_layer_map(data["domain_experts"], "domain_experts", path, moe_idx, num_experts)


def merge_expert_sets(*maps: Mapping[int, Iterable[int]] | None) -> ExpertSets:
    """Union of per-layer expert sets (``None`` entries are skipped); layers missing from a map add nothing."""
    out: ExpertSets = {}
    for m in maps:
        if m is None:
            continue
        for pos, experts in m.items():
            out.setdefault(int(pos), set()).update(int(e) for e in experts)
    return out
