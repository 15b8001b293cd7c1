"""Plain-MLX reference implementations of the two expert types (seed 002), used as test oracles.

Every weight rewrite (prune, merge, amplify, abliterate) is checked against these: they compute one expert's
output from dense weight matrices with no gather kernels, no sorting and no quantized matmul.
"""

from __future__ import annotations

import mlx.core as mx


def dense_weight(linear) -> mx.array:
    """(E, out, in) float weights of a SwitchLinear or QuantizedSwitchLinear (dequantized)."""
    if "scales" in linear:
        return mx.dequantize(
            linear["weight"],
            linear["scales"],
            linear.get("biases"),
            group_size=linear.group_size,
            bits=linear.bits,
            mode=linear.mode,
        )
    return linear["weight"]


def bias_of(linear):
    return linear["bias"] if "bias" in linear else None


def gemm3_swiglu(x, w_gate, w_up, w_down):
    """GEMM3_SWIGLU for one expert: down(silu(x Wg^T) * (x Wu^T)); weights (out, in) as stored by mlx-lm."""
    g = x @ w_gate.T
    u = x @ w_up.T
    return (g * mx.sigmoid(g) * u) @ w_down.T


def gemm2_bias_swiglu_clamp(x, w_gate_up, b_gate_up, w_down, b_down, alpha=1.702, beta=7.0):
    """GEMM2_BIAS_SWIGLU_CLAMP for one expert, literally as seed 002 writes it.

    ``w_gate_up`` is (in, 2I) with the two halves interleaved: columns ``::2`` are the clamped linear branch,
    ``1::2`` the gate that goes through min(·, β) and swish with α.
    """
    gate_up = x @ w_gate_up + b_gate_up
    slice_1 = gate_up[..., ::2]
    slice_2 = gate_up[..., 1::2]
    minimum_1 = mx.minimum(slice_2, beta)
    swish_1 = minimum_1 * mx.sigmoid(alpha * minimum_1)
    add_1 = mx.clip(slice_1, -beta, beta) + 1
    fused = add_1 * swish_1
    return fused @ w_down + b_down


def interleave_gate_up(w_up, w_gate):
    """(I, in) up and gate rows → (in, 2I) fused matrix with up at even and gate at odd columns."""
    I, D = w_up.shape
    return mx.stack([w_up.T, w_gate.T], axis=-1).reshape(D, 2 * I)


def reference_expert_outputs(switch_glu, x, inds, expert_type: str = "swiglu"):
    """(N, k, D) outputs of the chosen experts for tokens ``x`` (N, D), computed one expert at a time."""
    wg, wu, wd = (dense_weight(getattr(switch_glu, n)) for n in ("gate_proj", "up_proj", "down_proj"))
    bg, bu, bd = (bias_of(getattr(switch_glu, n)) for n in ("gate_proj", "up_proj", "down_proj"))
    N, k = inds.shape
    rows = []
    for t in range(N):
        outs = []
        for j in range(k):
            e = int(inds[t, j].item())
            xt = x[t : t + 1]
            if expert_type == "swiglu":
                outs.append(gemm3_swiglu(xt, wg[e], wu[e], wd[e])[0])
            else:
                fused = interleave_gate_up(wu[e], wg[e])
                b_fused = mx.stack([bu[e], bg[e]], axis=-1).reshape(-1)
                outs.append(gemm2_bias_swiglu_clamp(xt, fused, b_fused, wd[e].T, bd[e])[0])
        rows.append(mx.stack(outs))
    return mx.stack(rows)
