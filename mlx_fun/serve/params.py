"""The numbers of a completion body, checked before mlx-lm's handler sees them.

mlx-lm's server checks their types and some bounds itself, but lets NaN and infinities through (a NaN temperature
answers 200 with junk text; a NaN ``min_p`` ends its generation thread, and with it the server), takes any
``max_tokens`` (2**63 generates until the client gives up, and on), and raises on its generation thread — again
ending the server — for a ``top_k`` at or above the vocabulary size, a ``*_context_size`` past 2**62, a seed
past 2**64 - 1 or an ``xtc_threshold`` past 0.5 (its handler takes up to 1, its ``apply_xtc`` raises past 0.5). Here every such value is a 400 naming the field (:func:`check_numbers`), except a ``top_k``
at or above the vocabulary size, which keeps every token as the CLI's ``--top-k`` does (sent on as 0).

The sampling numbers the CLI also takes are checked by the CLI's own option types (``--temp``, ``--top-p``,
``--top-k``, ``--min-p``, ``--xtc-probability``, ``--xtc-threshold``, ``--seed``, ``--num-draft-tokens``, declared
once in :mod:`mlx_fun.core.ranges`; mlx-lm
takes a ``num_draft_tokens`` of 0, which drafts nothing, as mlx-fun's own option does not); the rest by the same
:class:`~mlx_fun.core.ranges.FiniteFloat` / ``click.IntRange`` with mlx-lm's bounds. ``max_tokens`` (and
``max_completion_tokens``) may be at most the server's ``--max-tokens-limit``, a ``*_context_size`` at most the
model's context length.
"""

from __future__ import annotations

import functools
import json

import click

from ..core.ranges import (DRAFT_TOKENS, MIN_P, SEED, TEMPERATURE, TOP_K, TOP_P, XTC_PROBABILITY, XTC_THRESHOLD,
                           FiniteFloat)
from .errors import HTTPError

#: fields that may be null (mlx-lm reads null as "not given")
NULLABLE = ("seed", "max_completion_tokens")
#: JSON booleans mlx-lm reads
FLAGS = ("stream", "logprobs")


@functools.cache
def _rules() -> dict[str, tuple[type, click.ParamType]]:
    """``{field: (int or float, the click type that checks its range)}`` for the fields every server shares."""
    # the CLI's ranges (declared once in mlx_fun.core.ranges), not a second copy of them
    return {
        "temperature": (float, TEMPERATURE), "top_p": (float, TOP_P), "top_k": (int, TOP_K),
        "seed": (int, SEED), "num_draft_tokens": (int, DRAFT_TOKENS),
        "min_p": (float, MIN_P), "repetition_penalty": (float, FiniteFloat(min=0.0)),
        "presence_penalty": (float, FiniteFloat()), "frequency_penalty": (float, FiniteFloat()),
        "xtc_probability": (float, XTC_PROBABILITY), "xtc_threshold": (float, XTC_THRESHOLD),
        "top_logprobs": (int, click.IntRange(-1, 11)),  # mlx-lm: 0..11, or -1 for none
    }


def _short(value) -> str:
    """``value`` as JSON (what the client sent), cut to 40 characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _number(name: str, value, kind: type, rule: click.ParamType, field: str | None = None):
    """``value`` checked as a JSON number of ``kind`` in ``rule``'s range (an int is a float's value too)."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if not (is_int or (kind is float and isinstance(value, float))):
        want = "an integer" if kind is int else "a number"
        raise HTTPError(400, f"{name} must be {want}, got {_short(value)}.", field or name)
    try:
        converted = rule.convert(value, None, None)
    except click.BadParameter as e:
        raise HTTPError(400, f"{name}: {e.message} Send a value in that range.", field or name) from None
    except OverflowError:  # an integer too large for a float
        raise HTTPError(400, f"{name}: {_short(value)} is not a finite number.", field or name) from None
    return kind(converted)


def check_numbers(body: dict, *, max_tokens_limit: int, context: int, vocab_size: int) -> None:
    """Refuse (400, naming the field) every number or flag of ``body`` out of its range; normalise in place."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > max_tokens_limit:
            raise HTTPError(400, f"{name} {value} is over this server's limit of {max_tokens_limit} "
                              "(--max-tokens-limit); ask for fewer.", name)
    positive = (int, click.IntRange(min=1))
    within_context = (int, click.IntRange(0, context))
    rules = {**_rules(), "max_tokens": positive, "max_completion_tokens": positive,
             **{f"{k}_context_size": within_context for k in ("repetition", "presence", "frequency")}}
    for name, (kind, rule) in rules.items():
        if name in body and not (body[name] is None and name in NULLABLE):
            body[name] = _number(name, body[name], kind, rule)
    if body.get("top_k", 0) >= vocab_size:
        body["top_k"] = 0  # as the CLI: k >= the vocabulary keeps every token (mlx-lm would raise mid-generation)
    for name in FLAGS:
        if name in body and not isinstance(body[name], bool):
            raise HTTPError(400, f"{name} must be true or false, got {_short(body[name])}.", name)
    _check_logit_bias(body.get("logit_bias"), vocab_size)


def _check_logit_bias(bias, vocab_size: int) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise HTTPError(400, "logit_bias must be an object mapping token ids to numbers.", "logit_bias")
    for k, v in bias.items():
        if not (k.isascii() and k.isdigit() and len(k) <= 12 and int(k) < vocab_size):
            raise HTTPError(400, f"logit_bias key {_short(k)}: keys are token ids 0..{vocab_size - 1}.", "logit_bias")
        _number(f"logit_bias[{k}]", v, float, _any_finite(), "logit_bias")


@functools.cache
def _any_finite() -> click.ParamType:
    return FiniteFloat()
