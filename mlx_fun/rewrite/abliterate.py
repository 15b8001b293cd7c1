"""Abliteration: remove a refusal direction from what a decoder layer *writes* into the residual stream.

For decoder layer ``i`` with unit direction ``d`` (its residual stream's harmful − benign mean,
:mod:`mlx_fun.observe.residual`), every matrix whose output is added to the residual stream is projected in its
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

The token embedding writes the residual stream too (Arditi et al. ablate the direction from it): :func:`embedding`
finds it beside the decoder layers, and ``embed=d`` projects its rows, ``E ← E − w · (E d) dᵀ`` (with tied
embeddings the output head reads the same table; a residual stream without ``d`` is read the same way).

Quantized matrices are dequantized, projected and re-quantized with their own bits, group size and mode, one
expert at a time, so the model keeps its format and size; the re-quantization feeds back what rounding would put
back along ``d`` (:func:`mlx_fun.rewrite.weights.stored_keeping`). :func:`apply` returns what it changed and an
undo record (:func:`restore`), which ``--search`` and the estimation rounds use: a later round puts the original
back and removes every round's direction from it at once, so a quantized model is rounded once, not once a round.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..adapters.base import MoEAdapter, expert_projections
from .weights import dense, dense_of, stored_keeping, write

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


def embedding(adapter: MoEAdapter) -> tuple[str, object] | None:
    """``(path, module)`` of the token embedding beside the decoder layers (the one (quantized) embedding of
    width ``hidden_size`` under the module that holds them), or ``None`` when there is not exactly one."""
    first = adapter.decoder_layers()[0]
    names = {id(m): n for n, m in adapter.model.named_modules()}
    layer_path = names.get(id(first), "")
    owner = layer_path.rsplit(".", 2)[0] + "." if layer_path.count(".") >= 2 else ""
    found = [(n, m) for n, m in adapter.model.named_modules()
             if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)) and n.startswith(owner)
             and (m.dims if isinstance(m, nn.QuantizedEmbedding) else m.weight.shape[-1]) == adapter.hidden_size]
    return found[0] if len(found) == 1 else None


def latent_experts(adapter: MoEAdapter) -> bool:
    """Do the routed experts write into a latent space (so no expert alone writes the residual stream)?"""
    return any(w.kind == "latent" for i in adapter.moe_layers()[:1] for w in writers(adapter, i))


def _stack(d: mx.array) -> mx.array:
    """One unit direction (H,) or an orthonormal stack (k, H), as a (k, H) stack."""
    return d[None] if d.ndim == 1 else d


def _project(w: mx.array, D: mx.array, weight: float) -> mx.array:
    """``w − weight · Dᵀ D w`` for an (out, in) matrix or an (out,) bias and orthonormal directions ``D`` (k, H):
    with orthogonal directions, removing them one after another is removing them at once."""
    return w - weight * D.T @ (D @ w)


def project_out(lin, d: mx.array, weight: float, experts: list[int] | None = None) -> dict:
    """Remove ``d`` (one unit direction (H,) or an orthonormal stack (k, H)) from the output space of ``lin`` —
    every expert of a switch linear, or ``experts`` — in place, re-quantizing so that the components along ``d``
    stay where the projection puts them; returns the undo record (the tensors it replaced)."""
    D = _stack(d)
    saved = {k: lin[k] for k in ("weight", "scales", "biases", "global_scale", "bias") if k in lin and lin[k] is not None}
    is_switch = lin["weight"].ndim == 3
    rows = (range(lin["weight"].shape[0]) if experts is None else experts) if is_switch else [None]
    parts = {}
    for e in rows:
        p = stored_keeping(lin, _project(dense(lin, e), D, weight), D)
        if "bias" in lin:
            b = lin["bias"] if e is None else lin["bias"][e]
            p["bias"] = _project(b.astype(mx.float32), D, weight)
        parts[e] = p
        mx.eval(list(p.values()))
    write(lin, parts)
    return saved


EMBED_ROWS = 16384  # rows of an embedding table projected (and re-quantized) at once


def project_rows(emb, d: mx.array, weight: float) -> dict:
    """Remove ``d`` (as in :func:`project_out`) from every row of an embedding table, ``E − weight · E Dᵀ D``, in
    place and in its own format, a block of rows at a time (rows are independent); returns the undo record."""
    D = _stack(d)
    saved = {k: emb[k] for k in ("weight", "scales", "biases", "global_scale") if k in emb and emb[k] is not None}
    n = saved["weight"].shape[0]
    step = n if "global_scale" in saved else EMBED_ROWS  # one per-tensor scale: quantized as one block
    blocks = []
    for a in range(0, n, step):
        block = {k: v if k == "global_scale" else v[a:a + step] for k, v in saved.items()}
        p = _project(dense_of(emb, block).T, D, weight).T
        blocks.append(stored_keeping(emb, p, D, axis=1))
        mx.eval(list(blocks[-1].values()))
    emb.update({k: blocks[0][k] if len(blocks) == 1 else mx.concatenate([b[k] for b in blocks]) for k in blocks[0]})
    return saved


def apply(adapter: MoEAdapter, dirs: np.ndarray, layers: list[int], *, target: str = "all", weight: float = 1.0,
          safety: dict[int, list[int]] | None = None, embed: np.ndarray | None = None) -> tuple[dict, list]:
    """Abliterate ``layers`` (decoder indices) with their rows of ``dirs`` — (decoder layers, H) unit directions,
    or (k, decoder layers, H) with each layer's k directions orthonormal, removed together; ``safety`` maps decoder
    layer → routed experts for ``target="safety-experts"``; ``embed``: a unit direction (H,) or an orthonormal
    stack (k, H) to remove from the token embedding too (:func:`embedding`; skipped for ``safety-experts``).
    Returns ``(touched: {layer or "embedding": [module paths, experts noted]}, undo)``."""
    touched, undo = {}, []
    dirs = np.asarray(dirs)
    stack = dirs[None] if dirs.ndim == 2 else dirs

    def f32(a):
        return mx.array(np.asarray(a, dtype=np.float32))

    found = projected_embedding(adapter, target) if embed is not None else None
    if found is not None:
        undo.append((found[1], project_rows(found[1], f32(embed), weight)))
        touched["embedding"] = [found[0]]
    for i in layers:
        names, saved = apply_layer(adapter, i, f32(stack[:, i]), target=target, weight=weight, safety=safety)
        undo += [(w.module, s) for w, s in saved]
        if names:
            touched[i] = names
    return touched, undo


def apply_layer(adapter: MoEAdapter, i: int, d: mx.array, *, target: str = "all", weight: float = 1.0,
                safety: dict[int, list[int]] | None = None) -> tuple[list[str], list[tuple[Writer, dict]]]:
    """:func:`apply` for decoder layer ``i`` alone, with its (k, H) orthonormal directions ``d`` (or one (H,)):
    ``(module paths touched, with the experts noted; [(writer, the tensors it replaced)]``)."""
    names, saved = [], []
    for w, experts, name in targets(adapter, i, target=target, safety=safety):
        saved.append((w, project_out(w.module, d, weight, experts)))
        names.append(name)
    return names, saved


def targets(adapter: MoEAdapter, i: int, *, target: str = "all", safety: dict[int, list[int]] | None = None
            ) -> list[tuple[Writer, list[int] | None, str]]:
    """The writers of decoder layer ``i`` that ``target`` projects (read from the layer's loaded shapes), each as
    ``(writer, the routed experts projected or None for all, the name apply reports)``."""
    out = []
    for w in writers(adapter, i):
        if w.kind not in KINDS_OF[target]:
            continue
        experts = None
        if target == "safety-experts":
            experts = sorted((safety or {}).get(i, []))
            if not experts:
                continue
        out.append((w, experts, w.path if experts is None else f"{w.path}[{', '.join(map(str, experts))}]"))
    return out


def projected_embedding(adapter: MoEAdapter, target: str) -> tuple[str, object] | None:
    """The token embedding a single direction is removed from (:func:`embedding`), None for ``safety-experts``."""
    return None if target == "safety-experts" else embedding(adapter)


def restore(undo: list) -> None:
    """Put back what :func:`apply` replaced (latest first)."""
    for module, saved in reversed(undo):
        module.update(saved)
