"""The router tap and auxiliary losses of the training scripts (train_tiny_moe, train_chat_moe).

Imports ``mlx.core``: import this module after ``mlx_fun.runtime.blas.maybe_reexec()``, as the scripts do.
"""

from __future__ import annotations

import mlx.core as mx

from mlx_fun.model import moe_hook


class RouterLog:
    """A tap on mlx-fun's hooked MoE call (the routing stays the adapter's, written once): keeps (router logits,
    softmax gates, chosen indices) of every MoE block during one traced forward, gradients included."""

    entries: list = []

    def __call__(self, layer, inds, weights, logits, y):
        RouterLog.entries.append((logits, mx.softmax(logits, axis=-1, precise=True), inds))


def install_router_log(model, config):
    from mlx_fun.adapters import get_adapter

    adapter = get_adapter(model, config)
    moe_hook.install(adapter, [RouterLog()])
    return adapter


def aux_losses(num_experts: int):
    """(Switch-Transformer load-balancing loss E · Σ_e f_e · P_e, router z-loss), each averaged over the MoE blocks
    :class:`RouterLog` saw."""
    bal, z = 0.0, 0.0
    for logits, gates, inds in RouterLog.entries:
        e = gates.shape[-1]
        probs = gates.reshape(-1, e)
        onehot = (inds.reshape(-1, inds.shape[-1])[..., None] == mx.arange(e)).astype(mx.float32)
        frac = mx.stop_gradient(onehot.sum(axis=(0, 1)) / onehot.sum())
        bal = bal + num_experts * mx.sum(frac * probs.mean(axis=0))
        z = z + mx.mean(mx.logsumexp(logits.astype(mx.float32), axis=-1) ** 2)
    n = max(1, len(RouterLog.entries))
    return bal / n, z / n
