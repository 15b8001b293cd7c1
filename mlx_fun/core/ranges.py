"""The value types and ranges of options the CLI and the REST server share, declared once: :class:`FiniteFloat`
(no nan / inf, optional bounds), :class:`JsonObject` (a JSON object given as text) and the sampling ranges (``SEED``,
``TEMPERATURE``, ``TOP_K``, ``TOP_P``, ``MIN_P``, ``MIN_TOKENS_TO_KEEP``, ``XTC_PROBABILITY``, ``XTC_THRESHOLD``,
``DRAFT_TOKENS``: mlx-lm's bounds). ``cli`` builds its options with them and ``serve.params`` checks a request's
numbers with them, so a value the CLI refuses is refused over REST too.
"""

from __future__ import annotations

import json
import math

import click


class FiniteFloat(click.ParamType):
    """A float that must be finite (no nan / inf) and within ``[min, max]`` (open ends with ``*_open``)."""

    name = "float"

    def __init__(self, min: float | None = None, max: float | None = None, *, min_open: bool = False,
                 max_open: bool = False):
        self.min, self.max, self.min_open, self.max_open = min, max, min_open, max_open

    def convert(self, value, param, ctx):
        if isinstance(value, float) and math.isfinite(value):
            x = value
        else:
            try:
                x = float(value)
            except (TypeError, ValueError):
                self.fail(f"{value!r} is not a number.", param, ctx)
        if not math.isfinite(x):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        low_bad = self.min is not None and (x <= self.min if self.min_open else x < self.min)
        high_bad = self.max is not None and (x >= self.max if self.max_open else x > self.max)
        if low_bad or high_bad:
            lo = "" if self.min is None else f"{self.min} {'<' if self.min_open else '<='} "
            hi = "" if self.max is None else f" {'<' if self.max_open else '<='} {self.max}"
            self.fail(f"{value} is not in the range {lo}x{hi}.", param, ctx)
        return x


#: the largest seed: ``random.Random``, numpy's ``default_rng`` and ``mx.random.key`` / ``mx.random.seed`` all take
#: 0 .. 2**64 - 1 (numpy refuses a negative seed, MLX one past a uint64)
MAX_SEED = 2**64 - 1
#: every ``--seed`` and the server's ``seed``
SEED = click.IntRange(0, MAX_SEED)
#: sampling: ``--temp`` / ``temperature``, ``--top-k`` / ``top_k``, ``--top-p`` / ``top_p``, ``--num-draft-tokens``
TEMPERATURE = FiniteFloat(min=0.0)
TOP_K = click.IntRange(min=0)
TOP_P = FiniteFloat(min=0.0, max=1.0, min_open=True)
DRAFT_TOKENS = click.IntRange(min=1)
MIN_P = FiniteFloat(0.0, 1.0)
MIN_TOKENS_TO_KEEP = click.IntRange(min=1)
XTC_PROBABILITY = FiniteFloat(0.0, 1.0)
#: mlx-lm's ``apply_xtc`` raises past 0.5 (its server takes up to 1 and then fails on the generation thread)
XTC_THRESHOLD = FiniteFloat(0.0, 0.5)


class JsonObject(click.ParamType):
    """A JSON object given as text (``'{"enable_thinking": false}'``), as a ``dict``; a ``dict`` as it is."""

    name = "json"

    def convert(self, value, param, ctx):
        if isinstance(value, dict):
            return value
        try:
            parsed = json.loads(value) if isinstance(value, str) else None
        except ValueError as e:
            self.fail(f"{value!r} is not JSON ({e}).", param, ctx)
        if not isinstance(parsed, dict):
            self.fail(f"{value!r} is not a JSON object such as '{{\"enable_thinking\": false}}'.", param, ctx)
        return parsed
