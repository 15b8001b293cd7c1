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


def dense_of(lin, parts: dict[str, mx.array]) -> mx.array:
    """The float32 matrix that ``parts`` (from :func:`stored`) hold, read with ``lin``'s format."""
    if "scales" not in parts:
        return parts["weight"].astype(mx.float32)
    return mx.dequantize(parts["weight"], parts["scales"], parts.get("biases"), group_size=lin.group_size,
                         bits=lin.bits, mode=lin.mode, global_scale=parts.get("global_scale"), dtype=mx.float32)


FEEDBACK_STEPS = 8
ERROR_GROWTH = 1.25  # the most element error (Frobenius, vs round-to-nearest) the feedback may add


def stored_keeping(lin, w: mx.array, dirs: mx.array, *, axis: int = 0) -> dict[str, mx.array]:
    """:func:`stored` for ``w``, keeping its components along the orthonormal ``dirs`` ((k, H) or one (H,)) on
    ``axis`` (0: its output space, ``D w``; 1: its rows, ``w Dᵀ``, an embedding table) through the rounding —
    zero after a full projection.

    Rounding to the storage grid puts part of a projected-out direction back: a weight already on a 4-bit grid
    moves less than half a step when a small direction is removed, so round-to-nearest mostly restores it (a
    quarter to a third of the component came back in a 4-bit model). Here what the rounding adds along ``dirs`` is
    fed back into the target and the matrix rounded again (an integrator, at most :data:`FEEDBACK_STEPS` times),
    keeping the storage closest to ``w``'s components among those whose element error stays within
    :data:`ERROR_GROWTH` of round-to-nearest's: 3-5x closer at 3-4 bits for 10-25% more element error. Only
    ``mx.quantize`` / ``dequantize`` are used, so it holds for every mode and for dtype casts.
    """
    D = dirs[None] if dirs.ndim == 1 else dirs

    def along(m):
        return D @ m if axis == 0 else m @ D.T

    def back(c):  # the change that moves the components along D by c
        return D.T @ c if axis == 0 else c @ D

    want = along(w)
    scale = max(mx.sum(w * w).item(), 1e-30)
    target, acc, best, limit = w, None, None, None
    for _ in range(FEEDBACK_STEPS):
        parts = stored(lin, target)
        got = dense_of(lin, parts)
        c = along(got) - want
        size, err = mx.sum(c * c).item(), mx.sum((got - w) ** 2).item()
        limit = ERROR_GROWTH ** 2 * err if limit is None else limit  # the first pass is round-to-nearest
        if err <= limit and (best is None or size < best[0]):
            best = (size, parts)
        if size <= 1e-12 * scale:
            break
        acc = c if acc is None else acc + c
        target = w - back(acc)
    return best[1]


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
