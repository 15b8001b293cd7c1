"""Expert steering (SteerMoE): which experts to force off or on, per MoE layer, and by which scheme.

A :class:`Steering` holds, per decoder layer, the experts to **deactivate** and to **activate**, and a scheme:
``rank`` (SteerMoE's, the default: per token, activated experts' logits set to the max + ε, deactivated ones to the
min − ε; at most top_k activated experts per layer) or ``additive`` (the original product's: ``mask_value`` −1e9 /
``boost_value`` +1e4 added to the router logits, which hands an activated expert almost all of a softmax router's
weight). :meth:`Steering.route_steers` turns it into the
``{MoE position: RouteSteer}`` that :mod:`mlx_fun.model.moe_hook` hands each adapter's ``route``, which applies it to the
logits and, where the family ranks by a selection-only score (sigmoid + correction bias), to that score too — so
group-limited and correction-bias routers steer with their own selection rules, and nothing here knows how any
family routes (:mod:`mlx_fun.adapters.steer`).

Sources: a ``safety_report.json`` (``safe``: activate its HCDG experts, the ones more active on the harmful prompts
the model refuses; ``unsafe``: deactivate them), a ``domain_report.json`` (``boost``: activate its domain experts;
``suppress``: deactivate its general experts) and direct ``{"deactivate": {"<layer>": [experts]}, "activate":
{...}}`` configs (the server's REST body). The report modes follow SteerMoE (adobe-research/SteerMoE,
``src/utils.py:steer_moe``; docs/benchmarks/parity.md): the experts that go with the behaviour to promote are
activated, those that go with it deactivated to suppress it; an activation takes the ``boost_experts`` of the group
that differ most (the report's ``ranked_by`` score, over all layers: SteerMoE activates 5 to 20 of thousands) and
then at most top_k of them per layer, since forcing every routing slot leaves a model nothing of its own to say.
Every check raises :class:`SteeringError` naming the offending field, which the CLI shows as one line and the server
as a 400.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..adapters.steer import SCHEMES
from ..errors import UserError
from .steer_options import BOOST_EXPERTS_DEFAULT, SCHEME_DEFAULT

MASK_VALUE = -1e9
BOOST_VALUE = 1e4
SAFETY_MODES = ("safe", "unsafe")
DOMAIN_MODES = ("boost", "suppress")


class SteeringError(UserError):
    """A bad steering config; ``field`` names the offending key (``deactivate.12``, ``mode``, ...)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name


@dataclass
class Steering:
    """Experts to force off / on, keyed by *decoder-layer index* (as reports and REST bodies name layers)."""

    deactivate: dict[int, list[int]] = field(default_factory=dict)
    activate: dict[int, list[int]] = field(default_factory=dict)
    mask_value: float = MASK_VALUE
    boost_value: float = BOOST_VALUE
    scheme: str = SCHEME_DEFAULT
    sources: list[dict] = field(default_factory=list)  # where the sets came from (report path and mode)
    warnings: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not any(self.deactivate.values()) and not any(self.activate.values())

    def to_json(self) -> dict:
        return {
            "deactivate": {str(k): v for k, v in sorted(self.deactivate.items()) if v},
            "activate": {str(k): v for k, v in sorted(self.activate.items()) if v},
            "scheme": self.scheme,
            "mask_value": self.mask_value,
            "boost_value": self.boost_value,
            "sources": self.sources,
            "warnings": self.warnings,
        }

    def route_steers(self, adapter) -> dict[int, "RouteSteer"]:  # noqa: F821
        """``{MoE position: RouteSteer}`` for ``adapter``'s model, for the layers this steering touches (what
        ``moe_hook.install`` / ``set_steer`` take; empty: no steering)."""
        from ..adapters.steer import RouteSteer

        pos_of = {layer: pos for pos, layer in enumerate(adapter.moe_layers())}
        out = {}
        for layer in sorted(set(self.deactivate) | set(self.activate)):
            on, off = self.activate.get(layer, []), self.deactivate.get(layer, [])
            if on or off:
                out[pos_of[layer]] = RouteSteer.build(self.scheme, adapter.num_experts, on, off, self.mask_value,
                                                      self.boost_value)
        return out


def _layer_key(key, where: str, moe_layer_indices: list[int]) -> int:
    text = str(key).strip()
    digits = text.lstrip("-")
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 9):  # int() refuses "²" and 5000 digits
        raise SteeringError(where, f"{where}: layer key {key!r} is not an integer decoder-layer index.")
    layer = int(text)
    if layer not in moe_layer_indices:
        raise SteeringError(f"{where}.{key}", f"{where}.{key}: layer {layer} is not an MoE layer of this model "
                                              f"(MoE layers: {_ranges(moe_layer_indices)}).")
    return layer


def _expert_list(value, where: str, num_experts: int) -> list[int]:
    if not isinstance(value, list):
        raise SteeringError(where, f"{where} must be a list of expert indices, got {type(value).__name__}.")
    out = []
    for e in value:
        if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < num_experts:
            raise SteeringError(where, f"{where} has expert {e!r}; experts are integers 0..{num_experts - 1}.")
        out.append(int(e))
    return sorted(set(out))


def _layer_map(obj, where: str, moe_layer_indices: list[int], num_experts: int) -> dict[int, list[int]]:
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise SteeringError(where, f"{where} must be an object mapping decoder-layer indices to expert lists, "
                                   f'e.g. {{"0": [3, 17]}}.')
    out: dict[int, list[int]] = {}
    for key, experts in obj.items():
        layer = _layer_key(key, where, moe_layer_indices)
        out[layer] = sorted(set(out.get(layer, [])) | set(_expert_list(experts, f"{where}.{key}", num_experts)))
    return out


def _finite(value, where: str, sign: int) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SteeringError(where, f"{where} must be a finite number, got {value!r}.")
    if value * sign <= 0:
        raise SteeringError(where, f"{where} must be {'negative' if sign < 0 else 'positive'}, got {value}.")
    tiny, big = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
    if not tiny <= abs(value) <= big:  # added to the router logits in float32: 0 (steers nothing) or infinite
        what = "rounds to 0" if abs(value) < tiny else "is infinite"
        raise SteeringError(where, f"{where} {value:g} {what} in float32, the precision it is added to the router "
                                   f"logits in; pass a {'negative' if sign < 0 else 'positive'} value of magnitude "
                                   f"{tiny:.3g} .. {big:.3g}.")
    return float(value)


def _ranges(xs: list[int]) -> str:
    xs = sorted(xs)
    if xs and xs == list(range(xs[0], xs[-1] + 1)):
        return f"{xs[0]}..{xs[-1]}"
    return ", ".join(map(str, xs))


def from_reports(
    *,
    moe_layer_indices: list[int],
    num_experts: int,
    top_k: int,
    safety_map: str | Path | None = None,
    safety_mode: str | None = None,
    domain_map: str | Path | None = None,
    domain_mode: str | None = None,
    deactivate=None,
    activate=None,
    mask_value=MASK_VALUE,
    boost_value=BOOST_VALUE,
    scheme: str = SCHEME_DEFAULT,
    boost_experts=BOOST_EXPERTS_DEFAULT,
    field_names: dict[str, str] | None = None,
) -> Steering:
    """Build and check one :class:`Steering` from reports and/or direct expert maps (their union).
    ``boost_experts``: how many of a report's experts ``safe`` / ``boost`` activate (see the module docstring).

    ``field_names`` renames parameters in messages (the server says ``mode`` where the CLI says
    ``--steering-mode``). Raises :class:`SteeringError` on the first problem.
    """
    from .expert_files import load_report_experts

    names = {"safety_map": "safety_map", "safety_mode": "safety_mode", "domain_map": "domain_map",
             "domain_mode": "domain_mode", "scheme": "scheme", "boost_experts": "boost_experts", **(field_names or {})}
    if scheme not in SCHEMES:
        raise SteeringError(names["scheme"], f"{names['scheme']} must be one of {', '.join(SCHEMES)}, got {scheme!r}.")
    if isinstance(boost_experts, bool) or not isinstance(boost_experts, int) or boost_experts < 1:
        raise SteeringError(names["boost_experts"], f"{names['boost_experts']} must be a positive integer, got "
                                                    f"{boost_experts!r}.")
    s = Steering(mask_value=_finite(mask_value, "mask_value", -1), boost_value=_finite(boost_value, "boost_value", 1),
                 scheme=scheme)
    s.deactivate = _layer_map(deactivate, "deactivate", moe_layer_indices, num_experts)
    s.activate = _layer_map(activate, "activate", moe_layer_indices, num_experts)
    reports = (("safety", safety_map, safety_mode, SAFETY_MODES, "safety_map", "safety_mode"),
               ("domain", domain_map, domain_mode, DOMAIN_MODES, "domain_map", "domain_mode"))
    for kind, path, mode, modes, path_key, mode_key in reports:
        if path is None:
            if mode is not None:
                raise SteeringError(names[mode_key], f"{names[mode_key]} is given without {names[path_key]}.")
            continue
        if mode not in modes:
            raise SteeringError(names[mode_key], f"{names[mode_key]} must be one of {', '.join(modes)} with "
                                                 f"{names[path_key]}, got {mode!r}.")
        boosting = mode in ("safe", "boost")
        try:
            which = {"suppress": "general", "safe": "hcdg", "unsafe": "hcdg"}.get(mode, kind)
            sets = load_report_experts(path, which, moe_layer_indices, num_experts)
            if boosting:
                sets = _strongest(sets, path, moe_layer_indices, top_k, boost_experts, warnings=s.warnings)
        except SteeringError:
            raise
        except UserError as e:
            raise SteeringError(names[path_key], str(e)) from None
        if not any(sets.values()):
            key = {"domain": "domain_experts", "general": "general_experts"}.get(which, which)
            s.warnings.append(f"{path}: its \"{key}\" map names no experts of this model's MoE layers, so "
                              f"{mode} steers nothing from it.")
        target = s.activate if boosting else s.deactivate
        for pos, experts in sets.items():
            layer = moe_layer_indices[pos]
            target[layer] = sorted(set(target.get(layer, [])) | set(experts))
        s.sources.append({"report": str(path), "kind": kind, "mode": mode}
                         | ({"boost_experts": boost_experts} if boosting else {}))
    _check(s, moe_layer_indices, num_experts, top_k)
    return s


def _strongest(sets: dict, path, moe_layer_indices: list[int], top_k: int, n: int, *, warnings: list) -> dict:
    """SteerMoE's choice of experts to activate: the ``n`` of ``sets`` with the highest score over all layers (the
    report's ``ranked_by`` score, else its composite; without scores for every cell, in layer and expert order), then
    at most ``top_k`` of those per layer (more cannot all be chosen)."""
    from collections import Counter

    cells = sorted((pos, e) for pos, experts in sets.items() for e in experts)
    score = _report_score(path)
    if score is not None and all(pos < score.shape[0] and e < score.shape[1] for pos, e in cells):
        cells.sort(key=lambda c: -score[c])  # stable: ties keep layer and expert order
    chosen = cells[:n]
    out: dict[int, set[int]] = {}
    for pos, e in chosen:
        out.setdefault(pos, set())
        if len(out[pos]) < top_k:
            out[pos].add(e)
    for pos, count in sorted(Counter(pos for pos, _ in chosen).items()):
        if count > top_k:
            warnings.append(f"layer {moe_layer_indices[pos]}: {count} of the {n} experts to activate are in this "
                            f"layer; the {top_k} that differ most are activated (top_k = {top_k}).")
    return out


def _report_score(path) -> np.ndarray | None:
    """The (MoE layers, experts) score a report ranks its groups by, or None where it has none."""
    from ..core import json_input

    try:
        report = json_input.read(path, allow_nan=True, error=ValueError)
        score = np.asarray(report["scores"][report.get("ranked_by", "composite")], dtype=np.float64)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return score if score.ndim == 2 and np.isfinite(score).all() else None


def for_adapter(adapter, **kwargs) -> Steering:
    """:func:`from_reports` for ``adapter``'s model (its MoE layers, expert count and top-k)."""
    return from_reports(moe_layer_indices=adapter.moe_layers(), num_experts=adapter.num_experts, top_k=adapter.top_k,
                        **kwargs)


def _check(s: Steering, moe_layer_indices: list[int], num_experts: int, top_k: int) -> None:
    for layer in moe_layer_indices:
        off, on = set(s.deactivate.get(layer, [])), set(s.activate.get(layer, []))
        both = sorted(off & on)
        if both:
            raise SteeringError(f"activate.{layer}", f"layer {layer}: expert(s) {both} are both activated and "
                                                     "deactivated; list each expert in one of them.")
        if num_experts - len(off) < top_k:
            raise SteeringError(f"deactivate.{layer}", f"layer {layer}: deactivating {len(off)} of {num_experts} "
                                                       f"experts leaves fewer than the {top_k} each token is routed "
                                                       "to; deactivate fewer.")
        if on and len(on) == num_experts - len(off):
            raise SteeringError(f"activate.{layer}", f"layer {layer}: activating all {len(on)} experts that are "
                                                     "not deactivated changes nothing (each token is routed among "
                                                     "them anyway); activate fewer, or none.")
        if len(on) > top_k and s.scheme == "rank":
            raise SteeringError(f"activate.{layer}", f"layer {layer}: {len(on)} experts are activated but the rank "
                                                     f"scheme puts them all at the top, so at most top_k = {top_k} "
                                                     "may be; activate fewer, or use the additive scheme.")
        if len(on) > top_k:
            s.warnings.append(f"layer {layer}: {len(on)} experts are activated but each token is routed to {top_k}; "
                              f"the {top_k} with the highest router logits win.")
