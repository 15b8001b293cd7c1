"""``mlx-fun amplify``: parses, calls :func:`mlx_fun.jobs.amplify.run`, prints."""

from __future__ import annotations

import click

from ..jobs import amplify
from .common import echo_err, friendly_errors
from .options import job_kwargs, job_options


@click.command("amplify", short_help="Permanently favour a domain's experts (router bias), loadable by mlx_lm.load.")
@job_options(amplify.run)
@friendly_errors
def command(**kwargs):
    """Add a boost to each domain expert's router bias — the family's own selection-only bias (DeepSeek-V3,
    GLM-4 MoE, MiniMax, … correction biases) or the router's linear bias (gpt-oss) — so the written model favours
    the domain with no hooks at inference time and opens with plain `mlx_lm.load`. Families whose router has no
    bias (qwen3_moe, mixtral, olmoe, …) are refused: boost them at run time with `steer` or `serve`.

    \b
    Example (a tiny random deepseek_v3 from scripts/tools/make_tiny_moe.py, scanned with domain-scan):
      mlx-fun amplify --model runs/tiny-dsv3 --domain-map runs/dsv3_domain.json --output runs/amplified --scale 1.0
    """
    show(amplify.run(**job_kwargs(amplify.run, kwargs), log=echo_err))


def show(result) -> None:
    n = sum(len(v) for v in result.boosted.values())
    click.echo(f"Wrote {result.output} ({n} domain experts boosted through the {result.target} bias; "
               "amplification_metadata.json beside the weights)")
