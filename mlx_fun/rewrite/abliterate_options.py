"""The option groups of ``abliterate`` (:func:`mlx_fun.jobs.abliterate.run`): how the refusal directions are
estimated (:class:`Estimate`), where and how strongly they are removed (:class:`Projection`) and how the result is
measured and searched (:class:`Evaluation`). Each is an option group (:class:`mlx_fun.core.options.Group`) whose
fields are the CLI's options (``--direction-layer`` is ``Estimate.direction_layer``), declared once with their
default, range or choices and help; a group checks itself when it is built (a one-line ``UserError`` naming the
option at fault, before anything loads)::

    from mlx_fun import jobs
    from mlx_fun.rewrite.abliterate_options import Estimate, Evaluation, Projection
    jobs.abliterate.run(model="data/tiny-moe-chat", harmful_dataset="h.jsonl", benign_dataset="b.jsonl",
                        output="abl", estimate=Estimate(rounds=1), projection=Projection(weight=0.8),
                        evaluation=Evaluation(eval_samples=32))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click

from ..core.options import Group, option
from ..core.ranges import FiniteFloat
from ..errors import UserError, param

DIRECTIONS = ("single", "per-layer")
#: where the residual stream is read (:data:`mlx_fun.observe.residual.POSITIONS`, named here so the CLI needs no MLX)
POSITIONS = ("last", "mean")
#: what the projection touches (:func:`mlx_fun.rewrite.abliterate.apply`)
TARGETS = ("all", "safety-experts", "dense-only")
_DATASET = "pass a JSONL file or a directory of text files"


@dataclass(frozen=True)
class Estimate(Group):
    """How the directions are measured. ``direction``: ``single`` (one, measured after ``direction_layer``;
    default: the largest un-normalised harmful - benign difference) or ``per-layer`` (each layer's own);
    ``extraction_position``: ``last`` token or ``mean`` over the prompt; ``phrasings``: directions per round, one
    per refusal phrasing; ``rounds``: estimation rounds, each on the model abliterated so far; ``refusal_filter``:
    only the harmful prompts the model refuses and the benign ones it answers (Arditi et al.), else every prompt."""

    direction: str = option(
        "single", "single: one direction (from --direction-layer) removed from every chosen layer and the token "
        "embedding (Arditi et al.); per-layer: each layer's own direction from its own writers.",
        type=click.Choice(DIRECTIONS))
    direction_layer: int | None = option(
        None, "Decoder layer the single direction is measured after [default: the largest un-normalised harmful - "
        "benign difference].", type=click.IntRange(min=0))
    extraction_position: str = option(
        "last", "Residual stream at each prompt's last token, or mean-pooled over its tokens.",
        type=click.Choice(POSITIONS))
    phrasings: int = option(
        4, "Directions per round, one per refusal phrasing (refused prompts grouped by their reply's first two words, "
        "4 or more each); 1: one direction from all refused prompts.", type=click.IntRange(min=1))
    rounds: int = option(
        2, "Estimation rounds: each re-measures the directions on the model abliterated so far, from the harmful "
        "prompts it still refuses and the benign ones it answers, and removes them too; stops early when fewer than 2 "
        "refusals are left, and undoes a round that takes the benign capture prompts' KL over --max-kl.",
        type=click.IntRange(min=1))
    refusal_filter: bool = option(
        True, "Take the directions from the harmful prompts the model refuses and the benign ones it answers (Arditi "
        "et al.); a model that refuses none of them (or all benign ones) is refused with the measured rates. "
        "--no-refusal-filter: from every prompt, whatever the model replies.",
        flag="--refusal-filter/--no-refusal-filter", default_text="refusal-filter")


@dataclass(frozen=True)
class Projection(Group):
    """Where and how strongly the directions are removed. ``layers``: ``auto`` (single direction: all; per-layer:
    the top half by direction norm), ``all`` or ``start-end``; ``target``: ``all`` writers, ``safety-experts`` (only
    the routed experts of ``safety_map``, a ``safety-scan`` report) or ``dense-only``; ``weight``: the fraction
    removed, in (0, 1]."""

    layers: str = option(
        "auto", "Layers whose writers are orthogonalised: auto (single direction: all; per-layer: the top half by the "
        "un-normalised direction norm), all, or start-end (e.g. 1-3).", type=click.STRING)
    target: str = option(
        "all", "all: attention, dense MLP, shared and every routed expert; safety-experts: only the report's routed "
        "experts; dense-only: everything but the routed experts.", type=click.Choice(TARGETS))
    weight: float = option(1.0, "Fraction of the direction removed (W - weight * d d^T W).",
                           type=FiniteFloat(0.0, 1.0, min_open=True))
    safety_map: str | Path | None = option(
        None, "safety_report.json (with --target safety-experts).", type=click.Path(dir_okay=False),
        missing="pass a safety_report.json written by `mlx-fun safety-scan`")

    def validate(self) -> None:
        if self.target == "safety-experts" and self.safety_map is None:
            raise UserError(f"{param('target')} safety-experts needs {param('safety_map')}: a safety_report.json "
                            "from `mlx-fun safety-scan`.")
        if str(self.layers).strip().lower() not in ("auto", "all"):
            from ..observe.residual import parse_layers

            parse_layers(self.layers, where=param("layers"))


@dataclass(frozen=True)
class Evaluation(Group):
    """How the result is measured and searched: the refusal rate and benign first-token KL on
    ``eval_harmful_dataset`` / ``eval_benign_dataset`` (held out; default: the capture datasets), ``eval_samples``
    prompts each, greedy replies of ``reply_tokens`` tokens; ``search``: settings of (layers, weight, direction
    layer) tried, the fewest refusals under ``max_kl`` kept (also the KL a later round may reach); ``kl_holdout``:
    benign prompts of the capture dataset the directions are not fitted on, where ``max_kl`` is checked
    (:func:`split_benign`)."""

    eval_harmful_dataset: str | Path | None = option(
        None, "Held-out harmful prompts for the refusal rate (default: --harmful-dataset).", missing=_DATASET)
    eval_benign_dataset: str | Path | None = option(
        None, "Held-out benign prompts for the refusal rate and first-token KL (default: --benign-dataset).",
        missing=_DATASET)
    eval_samples: int = option(64, "Evaluation prompts per set.", type=click.IntRange(min=1))
    reply_tokens: int = option(16, "Tokens of each greedy reply judged for a refusal.", type=click.IntRange(min=1),
                               cli=False)
    search: int = option(
        0, "Try this many (layers, weight, direction layer) settings, each measured after every round, and keep the "
        "fewest refusals under --max-kl.", type=click.IntRange(min=0))
    max_kl: float = option(
        0.5, "Largest first-token KL (nats) on the held-out benign prompts (--kl-holdout) that --search accepts and a "
        "later round may reach; a first round of several phrasings' directions over it falls back to one direction.",
        type=FiniteFloat(0.0, min_open=True))
    kl_holdout: int = option(
        32, "Benign prompts drawn beside the capture ones and kept out of the directions: --max-kl is checked, and "
        "the written model's KL reported, on them (at most half the prompts drawn; 0: on the capture prompts the "
        "directions were fitted on).", type=click.IntRange(min=0))

    @property
    def held_out(self) -> bool:
        return self.eval_harmful_dataset is not None and self.eval_benign_dataset is not None


def split_benign(samples: list, *, fit: int, holdout: int, seed: int | None) -> tuple[list, list]:
    """The benign prompts drawn (up to ``fit`` + ``holdout``: ``--max-samples`` + ``--kl-holdout``) split into those
    the directions are fitted on (at most ``fit``) and those held out for the KL bound: ``holdout``, or half of
    them when fewer were drawn (never leaving more than ``fit`` to fit on), chosen by ``random.Random(seed)``, each
    side kept in the dataset's order. Returns ``(fit, held_out)``; ``held_out`` is empty for ``holdout=0`` or a
    single prompt."""
    import random

    n = max(min(holdout, len(samples) // 2), len(samples) - fit)
    held = set(random.Random(seed).sample(range(len(samples)), n))
    return ([s for i, s in enumerate(samples) if i not in held], [s for i, s in enumerate(samples) if i in held])


def switched_off(name: str) -> str:
    """How a message names turning boolean option ``name`` off: ``--no-refusal-filter`` on the command line,
    ``refusal_filter=False`` from Python (:func:`mlx_fun.errors.param` names it ``--refusal-filter`` /
    ``refusal_filter=``)."""
    on = param(name)
    return f"{on}False" if on.endswith("=") else "--no-" + on.removeprefix("--")


__all__ = ["DIRECTIONS", "POSITIONS", "TARGETS", "Estimate", "Evaluation", "Projection", "split_benign",
           "switched_off"]
