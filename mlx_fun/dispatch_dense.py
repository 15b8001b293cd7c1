"""The runtime dispatch for dense quantized linears: dequantize-then-matmul where the backend's quantized matmul
does not scale with the token count.

MLX's CPU ``quantized_matmul`` costs the same per row at every M (no BLAS), while a dequantize plus a BLAS
matmul costs about the same at M = 1 and almost nothing per extra row. Measured on the 2-core Linux CPU
(OpenBLAS), 4-bit affine g64, ``x @ dequantize(W).T`` against ``nn.QuantizedLinear``:

==========  =======  =======  =======  =======  =======  =======
D × D        M = 1    M = 4    M = 8    M = 16   M = 64   M = 256
==========  =======  =======  =======  =======  =======  =======
512 × 512    0.35×    1.9×     2.6×     5.5×     11×      30×
2048 × 2048  0.20×    0.65×    1.3×     2.4×     8.4×     28×
==========  =======  =======  =======  =======  =======  =======

so from :data:`MIN_ROWS` rows on (8 on the CPU) a swapped ``QuantizedLinear`` (attention projections, dense MLPs,
routers, the LM head) takes the dequantized path; decode (M = 1) keeps MLX's. GPUs' quantized matmuls scale
(no entry: never swapped). The weights are dequantized at every call (nothing cached: a rewrite that changes
them is seen at once), in the input's dtype; only float32 inputs on the CPU (MLX's CPU matmul is fast in float32).
:func:`mlx_fun.dispatch.install` swaps them along with the experts; :func:`mlx_fun.dispatch.remove` restores them.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import classswap

#: rows (tokens) from which a dense quantized linear is run dequantized, per backend (table above)
MIN_ROWS = {"cpu": 8}
TAG = "dispatch-dense"
_STATE = "_mlxfun_dense_min_rows"


def dequantize_weight(module, dtype=None) -> mx.array:
    """The float (out, in) / (E, out, in) weight of a quantized linear or switch linear, as mlx-lm stores it."""
    kwargs = {}
    gs = getattr(module, "global_scale", None)
    if gs is not None:
        kwargs["global_scale"] = gs
    if dtype is not None:
        kwargs["dtype"] = dtype
    return mx.dequantize(module["weight"], module["scales"], module.get("biases"), module.group_size, module.bits,
                         mode=module.mode, **kwargs)


class DequantizedLinear(nn.QuantizedLinear):
    """mlx-lm's ``QuantizedLinear`` whose call runs dequantize-then-matmul from ``MIN_ROWS`` rows on."""

    def __call__(self, x: mx.array) -> mx.array:
        min_rows = self.__dict__.get(_STATE)
        if min_rows is None or x.dtype != mx.float32 or x.size < min_rows * x.shape[-1]:
            return nn.QuantizedLinear.__call__(self, x)
        y = x @ dequantize_weight(self, x.dtype).T
        if "bias" in self:
            y = y + self["bias"]
        return y


classswap.register(nn.QuantizedLinear, TAG, DequantizedLinear.__call__, DequantizedLinear)


def install(model, backend: str) -> int:
    """Swap every plain ``QuantizedLinear`` of ``model`` when ``backend`` has a cut-off; returns how many."""
    min_rows = MIN_ROWS.get(backend)
    if min_rows is None:
        return 0
    n = 0
    for _, module in model.named_modules():
        cls = type(module)
        if cls is nn.QuantizedLinear or cls is DequantizedLinear:
            classswap.set_state(module, _STATE, min_rows)
            classswap.swap(module, TAG, DequantizedLinear.__call__)
            n += 1
    return n


def remove(model) -> int:
    n = 0
    for _, module in model.named_modules():
        n += classswap.restore(module, TAG)
        classswap.drop_state(module, _STATE)
    return n
