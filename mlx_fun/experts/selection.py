"""Which experts to KEEP in every MoE layer: prune strategies, constraints, expert lists and report sets.

Everything here is pure numpy and works on saliency scores of shape ``(num_moe_layers, num_experts)``
(higher = more important, see :mod:`mlx_fun.observe.saliency`). Layers are addressed by their **position** among the
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

Expert-list files and safety / domain reports are read by :mod:`mlx_fun.experts.expert_files`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import click
import numpy as np

from ..core.options import Group, Opt, option
from ..errors import UserError, param

STRATEGIES = ("bottom", "strided")

KeptMap = dict[int, list[int]]
ExpertSets = dict[int, set[int]]


#: the saliency metrics an expert ranking can use (:meth:`mlx_fun.observe.saliency.SaliencyAccumulator.scores`)
METRICS = ("reap", "ean", "freq", "weighted_freq")
#: ``--metric``: one declaration for prune, merge and the ``stats-*`` commands
METRIC = Opt("Saliency metric: reap = mean(‖y‖·w), ean = mean(‖y‖), freq = routed count, weighted_freq = Σw.",
             type=click.Choice(METRICS))


@dataclass(frozen=True)
class Selection(Group):
    """Which experts go, by saliency (the option group ``selection`` of prune and merge; fields = their options).

    ``n_prune``: experts removed (prune) or merged away (merge) per layer, or expert indices removed from every
    layer with ``model_wide``; ``metric``: the saliency metric ranking them (:data:`METRICS`);
    ``model_wide``: the same indices in every layer (column sums); ``min_experts_per_layer``: with ``model_wide``,
    never keep fewer experts than this in a layer; ``ignore_experts``: with ``model_wide``, indices never removed
    (``"0,1,250..255"``). Built, it refuses ``n_prune < 1`` and ``ignore_experts`` without ``model_wide``."""

    n_prune: int | None = option(
        None, "Experts to remove (prune) or merge away (merge; E - n centroids stay) per layer, or expert indices "
        "removed from every layer with --model-wide.", type=click.IntRange(min=1))
    metric: str = option("reap", METRIC.help, type=METRIC.type)
    model_wide: bool = option(False, "Remove the same expert indices from every layer (column sums); merge keeps "
                              "the same centroid indices.")
    min_experts_per_layer: int = option(1, "With --model-wide: never keep fewer experts (centroids) than this in a "
                                        "layer.", type=click.IntRange(min=1))
    ignore_experts: str | None = option(None, 'With --model-wide: indices never pruned (always kept as centroids), '
                                        'e.g. "0,1,250..255".')

    def validate(self) -> None:
        if self.ignore_experts is not None and not self.model_wide:
            raise UserError(f"{param('ignore_experts')} only works with {param('model_wide')}.")

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
def parse_expert_ranges(text: str, num_experts: int | None = None, option: str | None = None) -> list[int]:
    """Parse ``"1,2,250..255"`` (inclusive ``a..b`` ranges, whitespace allowed) into a sorted, unique list.

    Raises ``UserError`` naming the bad token for empty entries, non-integers, negative numbers, reversed
    ranges and (when ``num_experts`` is given) indices ``>= num_experts``.
    """
    option = option or param("ignore_experts")
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
        raise UserError(f"{param('n_prune')} {n_prune} must be between 0 and {len(row) - 1} "
                        f"(the layer has {len(row)} experts).")
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
    n_flag, ignore_flag, wide_flag = param("n_prune"), param("ignore_experts"), param("model_wide")
    if strategy not in STRATEGIES:
        raise UserError(f"unknown {param('strategy')} '{strategy}'; choose one of {', '.join(STRATEGIES)}.")
    if not _is_int(top_k) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    if not _is_int(n_prune):
        raise UserError(f"{n_flag} must be an integer, got {n_prune!r}.")
    n_prune = int(n_prune)
    if n_prune < 0 or n_prune >= E:
        raise UserError(f"{n_flag} {n_prune} is out of range: the model has {E} experts per layer; use 0..{E - top_k}.")
    ignore = sorted(set(int(e) for e in ignore_experts)) if ignore_experts is not None else []
    if ignore and not model_wide:
        raise UserError(f"{ignore_flag} only works with {wide_flag}; add {wide_flag} or drop {ignore_flag}.")
    for e in ignore:
        if not 0 <= e < E:
            raise UserError(f"{ignore_flag}: expert {e} is out of range; the model has {E} experts (0..{E - 1}).")
    if not _is_int(min_experts_per_layer) or min_experts_per_layer < 1:
        raise UserError(f"{param('min_experts_per_layer')} must be at least 1, got {min_experts_per_layer}.")

    keep = E - n_prune
    if keep < top_k:
        raise UserError(
            f"{n_flag} {n_prune} would keep {keep} experts but top_k is {top_k}; prune at most {E - top_k}."
        )
    if keep < min_experts_per_layer:
        raise UserError(
            f"{n_flag} {n_prune} would keep {keep} experts per layer but {param('min_experts_per_layer')} is "
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
                f"{n_flag} {n_prune} is not a multiple of n_group={n_group}: group-limited routing needs the same "
                f"number of experts removed from each of the {n_group} groups; {hint}."
            )
        per_group = n_prune // n_group
        if gs - per_group < 2:
            raise UserError(
                f"{n_flag} {n_prune} would leave {gs - per_group} expert(s) in each of the {n_group} groups, "
                f"but each group needs at least 2 (groups are scored by their top-2 experts); prune at most "
                f"{n_group * (gs - 2)}."
            )
        if topk_group and topk_group * (gs - per_group) < top_k:
            raise UserError(
                f"{n_flag} {n_prune} would leave {gs - per_group} experts per group, so the topk_group={topk_group} "
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
        names = [f"all layers ({wide_flag})"]
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
            + f"; {n_flag} {n_prune} is too many: prune at most {allowed}, or protect fewer experts."
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
