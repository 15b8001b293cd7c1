"""REAP pruning: slice every expert-axis tensor of every MoE block to the kept experts.

The adapter lists the tensors (``expert_tensors``): router rows (weight / scales / biases / bias), correction
biases, and every projection tensor of the routed experts (weight / scales / biases / bias, global scales of
nvfp4) — never the shared experts. Quantized tensors stay quantized: packed weights, scales and biases are
sliced together along the expert axis, so float, affine 2–8 bit, mxfp4 and nvfp4 are all handled the same.
Slicing is lazy (``mx.take``): with a lazily loaded model only the kept rows are materialised when saved.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..adapters.base import MoEAdapter, expert_count
from ..errors import UserError


def check_keep_map(adapter: MoEAdapter, keep_map: dict[int, list[int]]) -> int:
    """Validate a keep map (block position → sorted kept expert indices); return the kept count per layer.

    mlx-lm builds every MoE layer with the one expert count of config.json, so every layer must keep the same
    number of experts.
    """
    n_layers, E = len(adapter.moe_layers()), adapter.num_experts
    counts = set()
    for pos in range(n_layers):
        kept = keep_map.get(pos, list(range(E)))
        if len(set(kept)) != len(kept) or any(not 0 <= int(e) < E for e in kept):
            raise UserError(f"kept experts of MoE layer {adapter.moe_layers()[pos]} must be distinct values in [0, {E}).")
        counts.add(len(kept))
    if len(counts) != 1:
        raise UserError(
            f"every MoE layer must keep the same number of experts (mlx-lm configs hold one count), got {sorted(counts)}; "
            "prune the same number from every layer."
        )
    n_kept = counts.pop()
    if adapter.groups:
        n_group, need = adapter.groups[0], adapter.group_min_experts
        if n_kept % n_group:
            raise UserError(
                f"this router picks experts in {n_group} groups, so the kept count ({n_kept}) must be divisible "
                f"by {n_group}; prune the same number from every group."
            )
        size = adapter.num_experts // n_group
        for pos in range(len(adapter.moe_layers())):
            per_group = np.bincount([int(e) // size for e in keep_map.get(pos, range(adapter.num_experts))],
                                    minlength=n_group)
            if len(set(per_group.tolist())) != 1:
                raise UserError(
                    f"MoE layer {adapter.moe_layers()[pos]} keeps {per_group.tolist()} experts of its {n_group} router "
                    "groups; keep the same number in every group, or tokens move between groups."
                )
        if n_kept // n_group < need:
            raise UserError(
                f"this router scores each of its {n_group} groups by its top {need} experts, so every group must keep "
                f"at least {need} (keep at least {n_group * need} experts per layer)."
            )
    return n_kept


def prune_block(adapter: MoEAdapter, block, kept: list[int]) -> None:
    """Slice every expert-axis tensor of ``block`` to ``kept`` (in place, lazily)."""
    idx = mx.array(sorted(int(e) for e in kept), dtype=mx.uint32)
    params = dict(tree_flatten(block.parameters()))
    updates = [(name, mx.take(params[name], idx, axis=0)) for name in adapter.expert_tensors(block)]
    block.update(tree_unflatten(updates))
    # keep the few attributes some blocks carry in sync (not used by the forward, but read by users)
    for owner, attr in ((block, "num_experts"), (block, "num_local_experts"), (getattr(block, "gate", None), "n_routed_experts")):
        if owner is not None and isinstance(getattr(owner, attr, None), int):
            setattr(owner, attr, len(idx))


def expert_rows(adapter: MoEAdapter, keep_map: dict[int, list[int]]) -> dict[str, list[int]]:
    """Full parameter name → kept rows (axis 0) of every tensor :func:`prune_model` will slice: what the
    streaming writer copies row by row from the source files (:mod:`mlx_fun.output.streaming`). Call before pruning."""
    prefix = {id(m): name for name, m in adapter.model.named_modules()}
    out: dict[str, list[int]] = {}
    for pos, block in enumerate(adapter.blocks()):
        kept = keep_map.get(pos)
        if kept is None or len(kept) == expert_count(adapter.experts(block)):
            continue
        base = prefix[id(block)]
        for name in adapter.expert_tensors(block):
            out[f"{base}.{name}" if base else name] = sorted(int(e) for e in kept)
    return out


def pruned_config(adapter: MoEAdapter, config: dict, n_kept: int) -> dict:
    """A copy of ``config`` with the routed-expert count set to ``n_kept`` wherever the family keeps it."""
    new = copy.deepcopy(config)
    for path in adapter.config_keys():
        node = new
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = n_kept
    return new


def prune_model(adapter: MoEAdapter, keep_map: dict[int, list[int]]) -> dict:
    """Prune ``adapter.model`` in place to ``keep_map`` (block position → kept experts); return the new config
    (also stored as ``adapter.config``).

    A group-limited router (n_group > 1) needs E divisible by n_group after pruning, and every group needs the
    experts it is scored by (``check_keep_map``).
    """
    n_kept = check_keep_map(adapter, keep_map)
    for pos, block in enumerate(adapter.blocks()):
        kept = keep_map.get(pos)
        if kept is not None and len(kept) != expert_count(adapter.experts(block)):
            prune_block(adapter, block, kept)
    adapter.config = pruned_config(adapter, adapter.config, n_kept)
    return adapter.config


def pruned_nbytes(adapter: MoEAdapter, n_kept: int) -> int:
    """Bytes the model's parameters will take with ``n_kept`` experts per MoE layer (nothing is evaluated):
    the estimate a writer checks free space against before pruning or merging."""
    from ..output.model_dir import params_nbytes

    total = params_nbytes(adapter.model)
    E = adapter.num_experts
    for block in adapter.blocks():
        params = dict(tree_flatten(block.parameters()))
        expert_bytes = sum(params[name].nbytes for name in adapter.expert_tensors(block))
        total -= expert_bytes * (E - n_kept) // max(E, 1)
    return total
