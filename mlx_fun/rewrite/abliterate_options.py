"""The option groups of ``abliterate`` (:func:`mlx_fun.jobs.abliterate.run`): how the refusal directions are
estimated (:class:`Estimate`), where and how strongly they are removed (:class:`Projection`) and how the result is
measured and searched (:class:`Evaluation`). Each is a frozen dataclass whose field names are the CLI's option
names (``--direction-layer`` is ``Estimate.direction_layer``), with the same defaults, and a ``check()`` that
raises a one-line ``UserError`` naming the option at fault before anything loads::

    from mlx_fun import jobs
    from mlx_fun.rewrite.abliterate_options import Estimate, Evaluation, Projection
    jobs.abliterate.run(model="data/tiny-moe-chat", harmful_dataset="h.jsonl", benign_dataset="b.jsonl",
                        output="abl", estimate=Estimate(rounds=1), projection=Projection(weight=0.8),
                        evaluation=Evaluation(eval_samples=32))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError, param, require_whole

DIRECTIONS = ("single", "per-layer")


@dataclass(frozen=True)
class Estimate:
    """How the directions are measured. ``direction``: ``single`` (one, measured after ``direction_layer``;
    default: the largest un-normalised harmful - benign difference) or ``per-layer`` (each layer's own);
    ``extraction_position``: ``last`` token or ``mean`` over the prompt; ``phrasings``: directions per round, one
    per refusal phrasing; ``rounds``: estimation rounds, each on the model abliterated so far; ``refusal_filter``:
    only the harmful prompts the model refuses and the benign ones it answers (Arditi et al.), else every prompt."""

    direction: str = "single"
    direction_layer: int | None = None
    extraction_position: str = "last"
    phrasings: int = 4
    rounds: int = 2
    refusal_filter: bool = True

    def check(self) -> "Estimate":
        from ..observe.residual import POSITIONS

        if self.extraction_position not in POSITIONS:
            raise UserError(f"{param('extraction_position')} must be one of {', '.join(POSITIONS)}, "
                            f"got {self.extraction_position!r}.")
        if self.direction not in DIRECTIONS:
            raise UserError(f"{param('direction')} must be one of {', '.join(DIRECTIONS)}, got {self.direction!r}.")
        layer = self.direction_layer
        if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int) or layer < 0):
            raise UserError(f"{param('direction_layer')} must be a decoder-layer index >= 0, got {layer!r}.")
        require_whole("rounds", self.rounds, 1)
        require_whole("phrasings", self.phrasings, 1)
        return self


@dataclass(frozen=True)
class Projection:
    """Where and how strongly the directions are removed. ``layers``: ``auto`` (single direction: all; per-layer:
    the top half by direction norm), ``all`` or ``start-end``; ``target``: ``all`` writers, ``safety-experts`` (only
    the routed experts of ``safety_map``, a ``safety-scan`` report) or ``dense-only``; ``weight``: the fraction
    removed, in (0, 1]."""

    layers: str = "auto"
    target: str = "all"
    weight: float = 1.0
    safety_map: str | Path | None = None

    def check(self) -> "Projection":
        from ..errors import require_path
        from ..observe.residual import parse_layers
        from .abliterate import TARGETS

        if self.target not in TARGETS:
            raise UserError(f"{param('target')} must be one of {', '.join(TARGETS)}, got {self.target!r}.")
        if self.target == "safety-experts":
            if self.safety_map is None:
                raise UserError(f"{param('target')} safety-experts needs {param('safety_map')}: a safety_report.json "
                                "from `mlx-fun safety-scan`.")
            require_path("safety_map", self.safety_map, "pass a safety_report.json written by `mlx-fun safety-scan`")
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w <= 1:
            raise UserError(f"{param('weight')} must be in (0, 1], got {w!r}.")
        parse_layers(self.layers, where=param("layers"))
        return self


@dataclass(frozen=True)
class Evaluation:
    """How the result is measured and searched: the refusal rate and benign first-token KL on
    ``eval_harmful_dataset`` / ``eval_benign_dataset`` (held out; default: the capture datasets), ``eval_samples``
    prompts each, greedy replies of ``reply_tokens`` tokens; ``search``: settings of (layers, weight, direction
    layer) tried, the fewest refusals under ``max_kl`` kept (also the KL a later round may reach)."""

    eval_harmful_dataset: str | Path | None = None
    eval_benign_dataset: str | Path | None = None
    eval_samples: int = 64
    reply_tokens: int = 16
    search: int = 0
    max_kl: float = 0.5

    @property
    def held_out(self) -> bool:
        return self.eval_harmful_dataset is not None and self.eval_benign_dataset is not None

    def check(self) -> "Evaluation":
        require_whole("search", self.search, 0)
        require_whole("eval_samples", self.eval_samples, 1)
        kl = self.max_kl
        if not (isinstance(kl, (int, float)) and math.isfinite(kl) and kl > 0):
            raise UserError(f"{param('max_kl')} must be a positive number, got {kl!r}.")
        return self


def switched_off(name: str) -> str:
    """How a message names turning boolean option ``name`` off: ``--no-refusal-filter`` on the command line,
    ``refusal_filter=False`` from Python (:func:`mlx_fun.errors.param` names it ``--refusal-filter`` /
    ``refusal_filter=``)."""
    on = param(name)
    return f"{on}False" if on.endswith("=") else "--no-" + on.removeprefix("--")


__all__ = ["DIRECTIONS", "Estimate", "Evaluation", "Projection", "switched_off"]
