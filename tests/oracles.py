"""Plain-MLX reference implementations of every expert type (``adapters.base.EXPERT_TYPES``), used as test oracles.

Every weight rewrite (prune, merge, amplify, abliterate) is checked against these: they compute one expert's
output from dense weight matrices with no gather kernels, no sorting and no quantized matmul.
"""

from __future__ import annotations

import math

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


def geglu_expert(x, w_gate, w_up, w_down):
    """gemma4: down(gelu_tanh(x Wg^T) * (x Wu^T)), the tanh approximation of GELU written out."""
    g = x @ w_gate.T
    gelu = 0.5 * g * (1 + mx.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
    return (gelu * (x @ w_up.T)) @ w_down.T


def relu2_mlp_expert(x, w1, w2, b1=None, b2=None):
    """nemotron_h: fc2(relu(fc1 x)²)."""
    h = x @ w1.T + (0 if b1 is None else b1)
    return (mx.maximum(h, 0) ** 2) @ w2.T + (0 if b2 is None else b2)


def gelu_mlp_expert(x, w1, w2, b1=None, b2=None):
    """phixtral: fc2(gelu_tanh(fc1 x + b1)) + b2 (mlx's ``GELU(approx="precise")`` is the tanh approximation)."""
    h = x @ w1.T + (0 if b1 is None else b1)
    gelu = 0.5 * h * (1 + mx.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
    return gelu @ w2.T + (0 if b2 is None else b2)


def clamped_swiglu_expert(x, w_gate, w_up, w_down, limit):
    """step3p5: down(min(silu(x Wg^T), limit) * clip(x Wu^T, -limit, limit)); limit 0 is plain SwiGLU."""
    g = x @ w_gate.T
    g = g * mx.sigmoid(g)
    u = x @ w_up.T
    if limit > 0:
        g, u = mx.minimum(g, limit), mx.clip(u, -limit, limit)
    return (g * u) @ w_down.T


def situ_expert(x, w_gate, w_up, w_down, beta=1.0, linear_beta=None):
    """kimi_k3: down(beta·tanh(g/beta)·sigmoid(g) · u'), u' = linear_beta·tanh(u/linear_beta) when set, else u."""
    g, u = x @ w_gate.T, x @ w_up.T
    a = beta * mx.tanh(g / beta) * mx.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * mx.tanh(u / linear_beta)
    return (a * u) @ w_down.T


def preclamped_swiglu_expert(x, w_gate, w_up, w_down, limit):
    """deepseek_v41: down(silu(min(x Wg^T, limit)) * clip(x Wu^T, -limit, limit)); limit 0 is plain SwiGLU."""
    g, u = x @ w_gate.T, x @ w_up.T
    if limit > 0:
        g, u = mx.minimum(g, limit), mx.clip(u, -limit, limit)
    return (g * mx.sigmoid(g) * u) @ w_down.T


def _one_expert(expert_type, xt, e, p, params):
    if expert_type == "swiglu_preclamp":
        return preclamped_swiglu_expert(xt, p["gate_proj"][e], p["up_proj"][e], p["down_proj"][e], params["limit"])
    if expert_type == "situ":
        return situ_expert(xt, p["gate_proj"][e], p["up_proj"][e], p["down_proj"][e], **params)
    if expert_type == "swiglu":
        return gemm3_swiglu(xt, p["gate_proj"][e], p["up_proj"][e], p["down_proj"][e])
    if expert_type == "swiglu_clamped":
        return clamped_swiglu_expert(xt, p["gate_proj"][e], p["up_proj"][e], p["down_proj"][e], params["limit"])
    if expert_type == "geglu":
        return geglu_expert(xt, p["gate_proj"][e], p["up_proj"][e], p["down_proj"][e])
    if expert_type == "swiglu_oai":  # biases absent (minimax_m3_vl) are zeros
        bias = {n: (mx.zeros(p[n].shape[1]) if p[n + "_bias"] is None else p[n + "_bias"][e])
                for n in ("gate_proj", "up_proj", "down_proj")}
        fused = interleave_gate_up(p["up_proj"][e], p["gate_proj"][e])
        b_fused = mx.stack([bias["up_proj"], bias["gate_proj"]], axis=-1).reshape(-1)
        return gemm2_bias_swiglu_clamp(xt, fused, b_fused, p["down_proj"][e].T, bias["down_proj"],
                                       alpha=params.get("alpha", 1.702), beta=params.get("limit", 7.0))
    fn = {"relu2_mlp": relu2_mlp_expert, "gelu_mlp": gelu_mlp_expert}[expert_type]
    b1, b2 = (None if p[n + "_bias"] is None else p[n + "_bias"][e] for n in ("fc1", "fc2"))
    return fn(xt, p["fc1"][e], p["fc2"][e], b1, b2)


def reference_expert_outputs(experts, x, inds, expert_type: str = "swiglu", **params):
    """(N, k, D) outputs of the chosen experts for tokens ``x`` (N, D), computed one expert at a time;
    ``params``: the activation's constants (``adapter.expert_params(block)``)."""
    names = ("fc1", "fc2") if hasattr(experts, "fc1") else ("gate_proj", "up_proj", "down_proj")
    p = {n: dense_weight(getattr(experts, n)) for n in names}
    p.update({n + "_bias": bias_of(getattr(experts, n)) for n in names})
    N, k = inds.shape
    rows = []
    for t in range(N):
        outs = [_one_expert(expert_type, x[t : t + 1], int(inds[t, j].item()), p, params)[0] for j in range(k)]
        rows.append(mx.stack(outs))
    return mx.stack(rows)
