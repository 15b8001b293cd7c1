"""Abliteration: remove a refusal direction from what a decoder layer *writes* into the residual stream.

For decoder layer ``i`` with unit direction ``d`` (its residual stream's harmful − benign mean,
:mod:`mlx_fun.residual`), every matrix whose output is added to the residual stream is projected in its
**output** space: ``W ← W − w · d dᵀ W`` for MLX's (out, in) layout, and its bias ``b ← b − w · d dᵀ b``
(``w``: ``--weight``, 0..1). Projecting the input side instead (a peer's mistake) would change what the matrix
reads, not what it writes.

The writers (:func:`writers`) are found by name in the layer's module tree — output projections whose output size
is the hidden size — and classified: ``attention`` (self-attention's ``o_proj``, linear-attention / Mamba
``out_proj``, Bailing's ``dense``), ``mlp`` (a dense layer's MLP ``down_proj``, a shared MLP beside the block),
``shared`` (the MoE block's shared experts), ``routed`` (the routed experts' output projection, every expert or
the listed ones; gpt-oss's with its bias) and ``latent`` (the up-projection that brings latent experts back to the
hidden size: nemotron_h, kimi_k3). Targets: ``all`` (every kind), ``dense-only`` (attention, mlp, shared) and
``safety-experts`` (only the routed experts a safety report lists, in their layers).

Quantized matrices are dequantized, projected and re-quantized with their own bits, group size and mode
(:mod:`mlx_fun.rewrite.weights`), one expert at a time, so the model keeps its format and size.
:func:`apply` returns what it changed and an undo record (:func:`restore`), which ``--search`` uses between trials.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..adapters.base import MoEAdapter, expert_projections
from .weights import dense, stored, write

TARGETS = ("all", "safety-experts", "dense-only")
ATTENTION_OUT = ("o_proj", "out_proj", "dense", "o_b_proj", "wo", "c_proj")
MLP_OUT = ("down_proj", "fc2", "w2", "output_linear")
LATENT_UP = ("fc2_latent_proj", "routed_expert_up_proj")
KINDS_OF = {"all": ("attention", "mlp", "shared", "routed", "latent"), "dense-only": ("attention", "mlp", "shared"),
            "safety-experts": ("routed",)}


@dataclass
class Writer:
    path: str  # module path within the decoder layer
    module: object
    kind: str  # attention | mlp | shared | routed | latent


def _out_dim(module) -> int | None:
    w = module.get("weight") if isinstance(module, dict) else None
    return None if w is None or w.ndim < 2 else int(w.shape[-2])


def writers(adapter: MoEAdapter, i: int) -> list[Writer]:
    """Every matrix of decoder layer ``i`` that writes into the residual stream, with its kind."""
    layer = adapter.decoder_layers()[i]
    H = adapter.hidden_size
    moe = i in adapter.moe_layers()
    block = adapter.block(i) if moe else None
    routed = getattr(adapter.experts(block), expert_projections(adapter.experts(block))[1]) if moe else None
    block_path = None
    if moe and block is not layer:
        block_path = next((name for name, m in layer.named_modules() if m is block), None)
    out = []
    for name, module in layer.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last not in ATTENTION_OUT + MLP_OUT + LATENT_UP or _out_dim(module) != H:
            continue  # (latent experts' own output projection writes the latent space: their up-projection counts)
        if module is routed:
            kind = "routed"
        elif last in LATENT_UP:
            kind = "latent"
        elif last in ATTENTION_OUT:
            kind = "attention"
        elif block_path is not None and (name + ".").startswith(block_path + "."):
            kind = "shared"
        elif moe and block is layer and last in MLP_OUT and "expert" in name:
            kind = "shared"
        else:
            kind = "mlp"
        out.append(Writer(name, module, kind))
    return out


def latent_experts(adapter: MoEAdapter) -> bool:
    """Do the routed experts write into a latent space (so no expert alone writes the residual stream)?"""
    return any(w.kind == "latent" for i in adapter.moe_layers()[:1] for w in writers(adapter, i))


def _project(w: mx.array, d: mx.array, weight: float) -> mx.array:
    """``w − weight · d dᵀ w`` for an (out, in) matrix or an (out,) bias."""
    if w.ndim == 1:
        return w - weight * d * mx.sum(d * w)
    return w - weight * d[:, None] * (d[None, :] @ w)


def project_out(lin, d: mx.array, weight: float, experts: list[int] | None = None) -> dict:
    """Remove ``d`` (unit, hidden size) from the output space of ``lin`` — every expert of a switch linear, or
    ``experts`` — in place; returns the undo record (the tensors it replaced)."""
    saved = {k: lin[k] for k in ("weight", "scales", "biases", "global_scale", "bias") if k in lin and lin[k] is not None}
    is_switch = lin["weight"].ndim == 3
    rows = (range(lin["weight"].shape[0]) if experts is None else experts) if is_switch else [None]
    parts = {}
    for e in rows:
        p = stored(lin, _project(dense(lin, e), d, weight))
        if "bias" in lin:
            b = lin["bias"] if e is None else lin["bias"][e]
            p["bias"] = _project(b.astype(mx.float32), d, weight)
        parts[e] = p
        mx.eval(list(p.values()))
    write(lin, parts)
    return saved


def apply(adapter: MoEAdapter, dirs: np.ndarray, layers: list[int], *, target: str = "all", weight: float = 1.0,
          safety: dict[int, list[int]] | None = None) -> tuple[dict, list]:
    """Abliterate ``layers`` (decoder indices) with their rows of ``dirs``; ``safety`` maps decoder layer →
    routed experts for ``target="safety-experts"``. Returns ``(touched: {layer: [module paths, experts noted]},
    undo)``."""
    kinds = KINDS_OF[target]
    touched, undo = {}, []
    for i in layers:
        d = mx.array(np.asarray(dirs[i], dtype=np.float32))
        names = []
        for w in writers(adapter, i):
            if w.kind not in kinds:
                continue
            experts = None
            if target == "safety-experts":
                experts = sorted((safety or {}).get(i, []))
                if not experts:
                    continue
            undo.append((w.module, project_out(w.module, d, weight, experts)))
            names.append(w.path if experts is None else f"{w.path}[{', '.join(map(str, experts))}]")
        if names:
            touched[i] = names
    return touched, undo


def restore(undo: list) -> None:
    """Put back what :func:`apply` replaced (latest first)."""
    for module, saved in reversed(undo):
        module.update(saved)
