"""Float views of (quantized) linear weights and writing them back in the module's own format.

A rewrite that changes weights (REAM's merged experts, abliteration's projections) reads a matrix as float32,
changes it, and must write it back exactly as the module stores it: float in its dtype, or re-quantized with the
module's own bits, group size and mode (affine, mxfp4, nvfp4 with its per-tensor global scale), so the output
has the input's size on disk and loads with plain ``mlx_lm.load``. ``e`` selects one expert of a
``SwitchLinear`` / ``QuantizedSwitchLinear`` (leading expert axis); ``None`` is a plain ``Linear``.
"""

from __future__ import annotations

import mlx.core as mx


def _pick(a, e):
    return a if e is None else a[e]


def dense(lin, e: int | None = None) -> mx.array:
    """The float32 (out, in) weight of ``lin`` (expert ``e`` of a switch linear)."""
    if "scales" in lin:
        gs = getattr(lin, "global_scale", None)
        return mx.dequantize(
            _pick(lin["weight"], e),
            _pick(lin["scales"], e),
            _pick(lin["biases"], e) if "biases" in lin else None,
            group_size=lin.group_size,
            bits=lin.bits,
            mode=lin.mode,
            global_scale=None if gs is None else _pick(gs, e),
            dtype=mx.float32,
        )
    return _pick(lin["weight"], e).astype(mx.float32)


def quantized_like(lin, w: mx.array) -> dict[str, mx.array]:
    """One (out, in) float matrix quantized like ``lin`` (same bits, group size, mode, scale dtype)."""
    if lin.mode == "affine":
        w = w.astype(lin["scales"].dtype)
    gs = getattr(lin, "global_scale", None)
    if gs is not None:
        g = mx.max(mx.abs(w)).astype(gs.dtype)
        q, s = mx.quantize(w, lin.group_size, lin.bits, mode=lin.mode, global_scale=g)[:2]
        return {"weight": q, "scales": s, "global_scale": g}
    q, s, *b = mx.quantize(w, lin.group_size, lin.bits, mode=lin.mode)
    out = {"weight": q, "scales": s}
    if b and "biases" in lin:
        out["biases"] = b[0]
    return out


def stored(lin, w: mx.array) -> dict[str, mx.array]:
    """``w`` (out, in) in ``lin``'s storage: its float dtype, or quantized like it."""
    return quantized_like(lin, w) if "scales" in lin else {"weight": w.astype(lin["weight"].dtype)}


def write(lin, parts: dict[int | None, dict[str, mx.array]]) -> None:
    """Put new tensors into ``lin``: ``parts[None]`` for a plain linear, ``parts[e]`` per expert of a switch linear
    (experts not in ``parts`` keep theirs). Keys: weight / scales / biases / global_scale / bias."""
    updates = {}
    for tensor in ("weight", "scales", "biases", "global_scale", "bias"):
        if tensor not in lin or lin[tensor] is None or not any(tensor in p for p in parts.values()):
            continue
        old = lin[tensor]
        if None in parts:
            updates[tensor] = parts[None][tensor].astype(old.dtype)
        else:
            rows = [parts[j][tensor] if j in parts and tensor in parts[j] else old[j] for j in range(old.shape[0])]
            updates[tensor] = mx.stack(rows).astype(old.dtype)
    lin.update(updates)
