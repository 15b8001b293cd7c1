"""The steering options ``steer`` and ``serve`` share, declared once (light: no numpy, no mlx, for ``--help``).

What the modes do is :mod:`mlx_fun.experts.steering`'s; these are their words and checks on the command line."""

from __future__ import annotations

import click

from ..core.options import Opt

#: the scheme steering uses unless told: SteerMoE's (the paper's rule; docs/benchmarks/parity.md)
SCHEME_DEFAULT = "rank"
#: how many of a report's experts ``safe`` / ``boost`` activate by default: SteerMoE's count for 4 of the 6 models
#: it publishes safety steering for (15 and 20 for the other two; its activations/num_experts.jsonl)
BOOST_EXPERTS_DEFAULT = 5

SAFETY_MODE = Opt("safe: activate the strongest of the report's HCDG experts, those more active on the harmful "
                  "prompts the model refuses (SteerMoE's safe steering; how many: the boost count below); unsafe: "
                  "deactivate them all.",
                  type=click.Choice(["safe", "unsafe"]))
BOOST_EXPERTS = Opt("How many of a report's experts safe / boost activate: those that differ most between its two "
                    "prompt sets, over all layers, then at most top_k per layer (SteerMoE activates 5 to 20).",
                    type=click.IntRange(min=1))
SCHEME = Opt("rank (SteerMoE's rule): per token, an activated expert's router logit goes to the largest + 0.01, a "
             "deactivated one's to the smallest - 0.01, so an activated expert weighs about as much as the token's "
             "favourite (at most top_k activated per layer); additive: add --mask-value / --boost-value to the "
             "router logits, so an activated expert takes almost all of a softmax router's weight.",
             type=click.Choice(["rank", "additive"]))
