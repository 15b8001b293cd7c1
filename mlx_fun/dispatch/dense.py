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
:func:`mlx_fun.dispatch.experts.install` swaps them along with the experts; :func:`mlx_fun.dispatch.experts.remove` restores them.

Half-precision scales (what ``mlx_lm.convert`` writes for a bfloat16 / float16 checkpoint: nearly every published
quantized model) on the CPU: MLX's CPU ``quantized_matmul`` is about 9× (bfloat16) and 45× (float16) slower than in
float32 at 64 rows, 7-13× and 27-40× at one (4-bit g32, 256 → 768;
``python -m scripts.benchmarks.bench_half_cpu``). Such a linear runs in float32 at every token count (below ``MIN_ROWS`` by :func:`upcast_scales`: the input, scales and
biases cast per call, a quarter of the packed weight's bytes at 4 bits and group size 32, an eighth at 64; the
packed weight is read as stored), and its output keeps the input's dtype. The tied LM head
(``QuantizedEmbedding.as_linear``) does the same. In ``--dispatch mlx-lm`` mode only this part is installed (at
every token count).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..core import classswap

#: rows (tokens) from which a dense quantized linear is run dequantized, per backend (table above)
MIN_ROWS = {"cpu": 8}
TAG = "dispatch-dense"
_STATE = "_mlxfun_dense_min_rows"
HALF = (mx.float16, mx.bfloat16)
NEVER = float("inf")  # min_rows of a linear swapped only to run in float32 (``--dispatch mlx-lm``)


def half_scales(module) -> bool:
    """A quantized (switch) linear or embedding whose scales are float16 / bfloat16 (affine, as mlx-lm writes it)."""
    scales = module.get("scales")
    return scales is not None and scales.dtype in HALF


def upcast_scales(module, select=None) -> tuple:
    """``(weight, scales, biases)`` of a quantized module with float32 scales and biases (rows ``select`` of each
    where given: the chosen experts); the packed weight as stored."""
    def pick(a):
        return a if a is None or select is None else a[select]
    biases = pick(module.get("biases"))
    return (pick(module["weight"]), pick(module["scales"]).astype(mx.float32),
            None if biases is None else biases.astype(mx.float32))


def _qmm32(module, x32):
    w, scales, biases = upcast_scales(module)
    return mx.quantized_matmul(x32, w, scales, biases, transpose=True, group_size=module.group_size,
                               bits=module.bits, mode=module.mode)


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
        half = half_scales(self)
        if min_rows is None or not (x.dtype == mx.float32 or half):
            return nn.QuantizedLinear.__call__(self, x)
        x32 = x.astype(mx.float32)
        if x.size >= min_rows * x.shape[-1]:
            y = x32 @ dequantize_weight(self, mx.float32).T
        elif half:
            y = _qmm32(self, x32)
        else:
            return nn.QuantizedLinear.__call__(self, x)
        if "bias" in self:
            y = y + self["bias"].astype(mx.float32)
        return y.astype(x.dtype)


class Float32HeadEmbedding(nn.QuantizedEmbedding):
    """mlx-lm's ``QuantizedEmbedding`` whose ``as_linear`` (a tied LM head) runs in float32 (half scales, CPU)."""

    def as_linear(self, x: mx.array) -> mx.array:
        return _qmm32(self, x.astype(mx.float32)).astype(x.dtype)


classswap.register(nn.QuantizedLinear, TAG, DequantizedLinear.__call__, DequantizedLinear)
classswap.register(nn.QuantizedEmbedding, TAG, nn.QuantizedEmbedding.__call__, Float32HeadEmbedding)


def install(model, backend: str, *, dequantize: bool = True) -> tuple[int, int]:
    """Swap the plain ``QuantizedLinear`` layers (and half-scale ``QuantizedEmbedding`` ones) of ``model`` when
    ``backend`` has a cut-off. ``dequantize=False`` (``--dispatch mlx-lm``): only the half-scale ones, to run in
    float32. Returns (linears swapped, modules with half-precision scales swapped: linears and tied heads)."""
    min_rows = MIN_ROWS.get(backend)
    if min_rows is None:
        return 0, 0
    n = half = 0
    for _, module in model.named_modules():
        cls = type(module)
        if (cls is nn.QuantizedEmbedding or cls is Float32HeadEmbedding) and half_scales(module):
            classswap.swap(module, TAG, nn.QuantizedEmbedding.__call__)
            half += 1
        elif (cls is nn.QuantizedLinear or cls is DequantizedLinear) and (dequantize or half_scales(module)):
            classswap.set_state(module, _STATE, min_rows if dequantize else NEVER)
            classswap.swap(module, TAG, DequantizedLinear.__call__)
            n += 1
            half += half_scales(module)
    return n, half


def remove(model) -> int:
    n = 0
    for _, module in model.named_modules():
        n += classswap.restore(module, TAG)
        classswap.drop_state(module, _STATE)
    return n
