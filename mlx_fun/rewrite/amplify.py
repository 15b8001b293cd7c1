"""Amplify: a permanent boost for domain experts, written into a router bias the family's mlx-lm class loads.

Where the boost goes (:func:`target`): a selection-only bias of the block (``e_score_correction_bias``,
``expert_bias``, ``router_bias``: added to the scores that pick the experts, not to their weights) when the family
has one, else the router's own linear bias (gpt-oss: added to the logits before its top-k). A family whose router
has neither (qwen3_moe, qwen2_moe, olmoe, mixtral, …) cannot be amplified without adding a parameter its mlx-lm
class would refuse to load, so :func:`target` returns None and the job says so; ``steer`` / ``serve`` boost such
models at run time instead.

``boost = scale × max(0, composite − threshold)`` per domain expert, from the domain report's composite scores.
:func:`largest_scale` bounds ``scale`` so that every boosted bias stays finite in its own dtype.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..adapters.base import MoEAdapter

SELECTION_BIASES = ("e_score_correction_bias", "expert_bias", "router_bias")


def target(adapter: MoEAdapter, block) -> tuple[str, str] | None:
    """``(parameter path relative to the block, "selection" | "logit")`` to add the boost to, or None."""
    E = adapter.num_experts
    params = dict(tree_flatten(block.parameters()))
    for name, value in params.items():
        if name.rsplit(".", 1)[-1] in SELECTION_BIASES and value.ndim == 1 and value.shape[0] == E:
            return name, "selection"
    router_bias = f"{adapter.router_attr}.bias"
    value = params.get(router_bias)
    if value is not None and value.ndim == 1 and value.shape[0] == E:
        return router_bias, "logit"
    return None


def boosts(composite: np.ndarray, domain: dict[int, set[int]], *, scale: float, threshold: float) -> np.ndarray:
    """(layers, experts) boost: ``scale × max(0, composite − threshold)`` on the domain experts, 0 elsewhere."""
    out = np.zeros_like(composite, dtype=np.float64)
    for pos, experts in domain.items():
        for e in experts:
            out[pos, e] = scale * max(0.0, float(composite[pos, e]) - threshold)
    return out


def _param(block, name: str):
    """``(owner module, attribute, value)`` of the block's parameter at dotted path ``name``."""
    obj = block
    *parents, leaf = name.split(".")
    for part in parents:
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj, leaf, getattr(obj, leaf)


def largest_scale(adapter: MoEAdapter, unit: np.ndarray) -> tuple[float, str]:
    """``(largest scale, dtype)``: the largest ``scale`` for which ``bias + scale × unit`` stays finite in every MoE
    block's target bias, in that bias's own dtype (``unit``: the boost at scale 1, >= 0; ``inf`` when it boosts
    nothing), with a one-in-a-million margin for the float32 sum's rounding; ``dtype`` names the first bias's."""
    limit, dtype = float("inf"), ""
    for pos, block in enumerate(adapter.blocks()):
        found = target(adapter, block)
        if found is None:
            continue
        old = _param(block, found[0])[2]
        dtype = dtype or str(old.dtype).rsplit(".", 1)[-1]
        d = np.asarray(unit[pos], dtype=np.float64)
        up = d > 0
        if up.any():
            room = float(mx.finfo(old.dtype).max) - np.array(old.astype(mx.float32), dtype=np.float64)[up]
            limit = min(limit, float(np.min(room / d[up])) * (1 - 1e-6))
    return limit, dtype


def changes(adapter: MoEAdapter, boost: np.ndarray) -> bool:
    """Whether adding ``boost`` changes any target bias in its own dtype (a boost far below a bias's precision,
    a tiny ``scale`` on a float16 bias, rounds away: :func:`apply` would write the bias unchanged)."""
    for pos, block in enumerate(adapter.blocks()):
        found = target(adapter, block)
        if found is None or not boost[pos].any():
            continue
        old = _param(block, found[0])[2]
        new = (old.astype(mx.float32) + mx.array(boost[pos], dtype=mx.float32)).astype(old.dtype)
        if not mx.array_equal(new, old).item():
            return True
    return False


def apply(adapter: MoEAdapter, boost: np.ndarray) -> list[str]:
    """Add ``boost[pos]`` to each MoE block's target parameter (in its dtype); returns the parameter paths."""
    paths = []
    for pos, block in enumerate(adapter.blocks()):
        found = target(adapter, block)
        if found is None:
            raise ValueError(f"MoE layer {adapter.moe_layers()[pos]} has no router bias to amplify")
        name, _ = found
        obj, leaf, old = _param(block, name)
        setattr(obj, leaf, (old.astype(mx.float32) + mx.array(boost[pos], dtype=mx.float32)).astype(old.dtype))
        paths.append(f"layer {adapter.moe_layers()[pos]}: {name}")
    return paths
