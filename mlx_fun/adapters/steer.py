"""One MoE layer's steering, as the adapters apply it inside ``route``: which experts to force on (boost) or off
(suppress), and how.

Two schemes:

- ``additive`` (the seed's): ``value`` — ``mask_value`` (−1e9) for suppressed experts, ``boost_value`` (+1e4) for
  boosted ones, 0 elsewhere — is added to the router logits before the family's activation and selection.
- ``rank`` (SteerMoE's): per token, boosted experts' router logits are set to the maximum over experts + ε and
  suppressed ones to the minimum − ε, everything else untouched. On a softmax router this is the paper's rule on
  the log-softmax (a per-token shift of the logits), so a boosted expert is chosen with about the weight of the
  token's favourite expert instead of all of it.

Where a family picks its experts by a *selection-only* score — a sigmoid (or softmax) plus a correction bias
(DeepSeek-V3, GLM-4.5, MiniMax, Bailing, ...) — steering the logits alone guarantees nothing: a suppressed
expert's sigmoid is 0 but its correction bias may still be the largest. So the same rule is applied a second
time to the selection score itself, right before the family's group limit and top-k: :meth:`RouteSteer.selection`
where the adapter forms that score inline, :meth:`RouteSteer.correction` where the model file's own compiled
selection function adds the correction bias (it is handed ``bias + (steered − unsteered score)``). Weights still
come from the family's own formula over the (steered) logits, so a boost never weighs more than a sigmoid's 1.

Nothing here knows how a family routes; each adapter says where its logits and selection scores are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

SCHEMES = ("additive", "rank")
RANK_EPS = 1e-2


@dataclass(frozen=True)
class RouteSteer:
    """Per-layer steering: ``boost``/``suppress`` are (E,) bool arrays, ``value`` the (E,) additive bias."""

    scheme: str
    boost: mx.array
    suppress: mx.array
    value: mx.array
    eps: float = RANK_EPS

    @classmethod
    def build(cls, scheme: str, num_experts: int, boost, suppress, mask_value: float, boost_value: float,
              eps: float = RANK_EPS) -> "RouteSteer":
        if scheme not in SCHEMES:
            raise ValueError(f"steering scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
        # built in NumPy: plain constants, no lazy graph (the server builds them on an HTTP thread and its
        # generation thread uses them; an unevaluated MLX graph is tied to the stream of the thread that made it)
        on, off = np.zeros(num_experts, bool), np.zeros(num_experts, bool)
        on[list(boost)] = True
        off[list(suppress)] = True
        value = np.where(off, mask_value, np.where(on, boost_value, 0.0)).astype(np.float32)
        return cls(scheme, mx.array(on), mx.array(off), mx.array(value), float(eps))

    def _ranked(self, t: mx.array, floor: float | None = None) -> mx.array:
        """``t`` with boosted entries at the per-token max + ε and suppressed ones at the per-token min − ε (or below
        ``floor`` when that is lower: what a group-limited selection writes into dropped groups). Computed in float32
        with an ε that survives the cast back to ``t``'s dtype."""
        f = t.astype(mx.float32)
        hi, lo = f.max(axis=-1, keepdims=True), f.min(axis=-1, keepdims=True)
        if floor is not None:
            lo = mx.minimum(lo, floor)
        ulp = mx.finfo(t.dtype).eps if mx.issubdtype(t.dtype, mx.floating) else 0.0
        eps_hi = mx.maximum(self.eps, 4 * ulp * mx.abs(hi))
        eps_lo = mx.maximum(self.eps, 4 * ulp * mx.abs(lo))
        out = mx.where(self.boost, hi + eps_hi, mx.where(self.suppress, lo - eps_lo, f))
        return out.astype(t.dtype)

    def _added(self, t: mx.array) -> mx.array:
        return t + (self.value if t.dtype == mx.float32 else self.value.astype(t.dtype))

    def logits(self, logits: mx.array) -> mx.array:
        """The router logits as the family's activation and selection should see them."""
        return self._added(logits) if self.scheme == "additive" else self._ranked(logits)

    def selection(self, scores: mx.array) -> mx.array:
        """A selection-only score (activation + correction bias), right before group limit and top-k."""
        return self._added(scores) if self.scheme == "additive" else self._ranked(scores, floor=0.0)

    def correction(self, bias: mx.array | None, unbiased: Callable[[], mx.array]) -> mx.array:
        """The correction bias to hand a compiled selection function that computes ``unbiased() + bias``, so that
        it ranks by :meth:`selection` of that sum. ``unbiased`` (the activation of the steered logits, as the
        function computes it) is only evaluated for the rank scheme; ``bias`` may be None (no correction bias)."""
        if self.scheme == "additive":
            return self.value if bias is None else bias + self.value.astype(bias.dtype)
        s = unbiased()
        biased = s if bias is None else s + bias.astype(s.dtype)
        return self.selection(biased) - s


def steered(logits: mx.array, steer: RouteSteer | None) -> mx.array:
    """``logits`` steered (:meth:`RouteSteer.logits`), or themselves when the layer is not steered."""
    return logits if steer is None else steer.logits(logits)


def steered_selection(scores: mx.array, steer: RouteSteer | None) -> mx.array:
    """A selection-only score steered (:meth:`RouteSteer.selection`), or itself when the layer is not steered."""
    return scores if steer is None else steer.selection(scores)


def steered_correction(bias, steer: RouteSteer | None, unbiased: Callable[[], mx.array]):
    """The correction bias for a compiled selection function (:meth:`RouteSteer.correction`), or ``bias`` itself."""
    return bias if steer is None else steer.correction(bias, unbiased)


def selection_order(probs: mx.array, steered_logits: mx.array, steer: RouteSteer | None) -> mx.array:
    """What a softmax-first router takes its top-k over: its probabilities, or, when steered, the steered logits
    (the same order): an additive boost of +1e4 saturates the softmax, leaving every other expert — masked ones
    included — tied at probability 0, so the rest of the choice would be arbitrary."""
    return probs if steer is None else steered_logits
