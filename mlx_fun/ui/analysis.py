"""What the Merge Mode Comparison and Diff Analysis tabs compute, from the functions the CLI uses.

- :func:`compare` — 2–4 saliency files rank-merged (:func:`mlx_fun.observe.stats.rank_merge`, as ``stats-merge``), the
  rank-sum filters turned into protected / targeted experts, and the experts to remove chosen by
  :func:`mlx_fun.experts.selection.select_experts` (as ``prune``: per layer or model-wide), checked by
  :func:`~mlx_fun.experts.selection.check_keep_counts`; :func:`export` writes the result with
  :func:`mlx_fun.experts.expert_files.save_expert_list`, the format ``prune`` / ``merge --expert-list`` read.
- :func:`diff` — the ``stats-diff`` report (:func:`mlx_fun.observe.stats.diff_files`, which the job calls too).

File names are taken relative to the UI's data directory and must resolve inside it (:func:`inside`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import UserError

ACTIONS = ("analyze", "prune", "merge")
#: what a comparison does with an expert: the Experts table's status column, and the categories of its map
STATUSES = ("keep", "keep (protected)", "keep (targeted)", "remove", "remove (targeted)")


def inside(root: Path, name: str, what: str) -> Path:
    """``name`` (relative to ``root`` or absolute) resolved, symlinks followed; it must lie inside ``root``."""
    if not isinstance(name, str) or not name.strip() or "\x00" in name:
        raise UserError(f"{what}: give a file name inside the data directory {root}.")
    p = Path(name.strip()).expanduser()
    resolved = (p if p.is_absolute() else root / p).resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise UserError(f"{what} {name!r} lies outside the UI's data directory {root} (--data-dir); name a file "
                        "inside it.")
    return resolved


def _existing(root: Path, names: Sequence[str], what: str) -> list[Path]:
    paths = [inside(root, n, what) for n in names]
    for p, n in zip(paths, names):
        if not p.is_file():
            raise UserError(f"{what} {n!r} does not exist in {root}; save one from Controls or `mlx-fun collect`.")
    return paths


@dataclass
class Comparison:
    metric: str
    files: list[str]
    moe_layer_indices: list[int]
    num_experts: int
    top_k: int
    model_type: str
    rank_sum: np.ndarray  # (MoE layers, experts), lower = more important
    ranks: list[np.ndarray]  # per file, (MoE layers, experts), 1 = most important
    kept: dict[int, list[int]]  # layer position -> kept experts
    protected: np.ndarray  # bool (MoE layers, experts)
    targeted: np.ndarray
    action: str
    warnings: list[str] = field(default_factory=list)

    @property
    def removed(self) -> dict[int, list[int]]:
        from ..experts.selection import removed_from_kept

        return removed_from_kept(self.kept, self.num_experts)

    def statuses(self) -> np.ndarray:
        """(MoE layers, experts): each expert's index in :data:`STATUSES`."""
        removed = self.removed
        codes = np.zeros((len(self.moe_layer_indices), self.num_experts), dtype=np.int64)
        for p in range(codes.shape[0]):
            gone = np.zeros(self.num_experts, dtype=bool)
            gone[removed.get(p, [])] = True
            marked = np.where(self.protected[p], 1, np.where(self.targeted[p], 2, 0))
            codes[p] = np.where(gone, 3 + (marked > 0), marked)  # removed: "remove" or "remove (targeted)"
        return codes

    def rows(self) -> list[list]:
        """One row per (layer, expert): decoder layer, expert, rank sum, per-file ranks, status."""
        codes = self.statuses()
        return [[layer, e, float(self.rank_sum[p, e]), *[int(r[p, e]) for r in self.ranks], STATUSES[codes[p, e]]]
                for p, layer in enumerate(self.moe_layer_indices) for e in range(self.num_experts)]

    def summary(self) -> str:
        n_removed = sum(len(v) for v in self.removed.values())
        return (f"{len(self.files)} files rank-merged by {self.metric}: {len(self.moe_layer_indices)} MoE layers × "
                f"{self.num_experts} experts; {int(self.protected.sum())} protected, {int(self.targeted.sum())} "
                f"targeted; {n_removed} to remove ({self.action}).")


def compare(*, root: Path, files: Sequence[str], metric: str = "reap", n_prune: int = 0, model_wide: bool = False,
            protect_max_rank_sum: float | None = None, target_min_rank_sum: float | None = None,
            action: str = "analyze") -> Comparison:
    """Rank-merge ``files`` and choose ``n_prune`` experts to remove per layer (or model-wide): experts whose
    rank sum is at most ``protect_max_rank_sum`` are protected (important in every file), those at least
    ``target_min_rank_sum`` are removed first."""
    from ..experts.selection import check_keep_counts, select_experts
    from ..observe.stats import layer_ranks, merge_warnings, rank_merge

    files = [str(f).strip() for f in files if f and str(f).strip()]
    if not 2 <= len(files) <= 4:
        raise UserError(f"choose 2 to 4 saliency files to compare, got {len(files)}.")
    if action not in ACTIONS:
        raise UserError(f"action must be one of {', '.join(ACTIONS)}, got {action!r}.")
    if n_prune is None or int(n_prune) != n_prune or n_prune < 0:
        raise UserError(f"N to prune must be a whole number, 0 or more, got {n_prune!r}.")
    from ..observe.saliency import SaliencyAccumulator

    accs = [SaliencyAccumulator.load(p) for p in _existing(root, files, "saliency file")]
    merged = rank_merge(accs, metric, labels=files)
    rank_sum = merged.extra[f"rank_sum_{metric}"]
    L, E = rank_sum.shape
    protected = np.zeros((L, E), bool) if protect_max_rank_sum is None else rank_sum <= protect_max_rank_sum
    targeted = np.zeros((L, E), bool) if target_min_rank_sum is None else rank_sum >= target_min_rank_sum
    targeted &= ~protected
    kept = select_experts(merged.scores(metric), int(n_prune), top_k=merged.top_k, model_wide=model_wide,
                          protected={p: np.flatnonzero(protected[p]).tolist() for p in range(L)},
                          targeted={p: np.flatnonzero(targeted[p]).tolist() for p in range(L)},
                          moe_layer_indices=list(merged.moe_layer_indices))
    warnings = merge_warnings(accs, metric, files)
    warnings += check_keep_counts(kept, E, merged.top_k, moe_layer_indices=list(merged.moe_layer_indices))
    return Comparison(metric, list(files), list(merged.moe_layer_indices), E, merged.top_k, merged.model_type,
                      rank_sum, [layer_ranks(a.scores(metric)) for a in accs], kept, protected, targeted, action,
                      warnings)


def export(comparison: Comparison, *, root: Path, name: str) -> Path:
    """Write the comparison's removals as ``name`` (``.json`` or ``.csv``) inside ``root``, atomically."""
    from ..experts.expert_files import save_expert_list

    path = inside(root, name, "export file")
    if path.suffix.lower() not in (".json", ".csv"):
        raise UserError(f"export file {name!r} must end in .json or .csv (the formats --expert-list reads).")
    if not any(comparison.removed.values()):
        raise UserError("the comparison removes no expert; set N to prune (or a remove-first threshold) and "
                        "Compare again before exporting.")
    return save_expert_list(path, comparison.kept, num_experts=comparison.num_experts,
                            moe_layer_indices=comparison.moe_layer_indices, model_type=comparison.model_type,
                            mode="merge" if comparison.action == "merge" else "prune", flag="export file",
                            force_flag="")


def diff(*, root: Path, file1: str, file2: str, metric: str = "reap", output: str | None = None) -> dict:
    """The ``stats-diff`` job's report of ``file1`` − ``file2`` (both inside ``root``), also written as JSON to
    ``output`` (inside ``root``) as ``stats-diff --output`` writes it (:func:`mlx_fun.observe.stats.diff_files`, the job's
    own report, through the one writer)."""
    from ..core import writer
    from ..observe.stats import diff_files

    p1, p2 = _existing(root, [file1, file2], "saliency file")
    inputs = {"saliency file 1": p1, "saliency file 2": p2}
    out = None
    if output is not None:
        out = inside(root, output, "export file")
        if out.suffix.lower() != ".json":
            raise UserError(f"export file {output!r} must end in .json.")
        writer.check_output_path(out, kind="file", inputs=inputs, flag="export file", force_flag="")
    report = diff_files(p1, p2, metric)
    if out is not None:
        writer.write_json(out, report, inputs=inputs, flag="export file", force_flag="")
    return report
