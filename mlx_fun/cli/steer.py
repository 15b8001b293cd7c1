"""``mlx-fun steer``: parses, calls :func:`mlx_fun.jobs.steer.run` (text streamed), prints."""

from __future__ import annotations

import click

from .common import (
    SEED,
    TEMPERATURE,
    FiniteFloat,
    dispatch_option,
    echo_err,
    friendly_errors,
    generation_options,
    model_option,
    run_settings,
    take,
)


@click.command("steer", short_help="Generate with safety / domain experts forced on or off (SteerMoE).")
@model_option
@click.option("--prompt", required=True, help="Prompt text (raw unless --chat).")
@click.option("--safety-map", type=click.Path(dir_okay=False), default=None,
              help="safety_report.json from `mlx-fun safety-scan` (with --mode).")
@click.option("--mode", type=click.Choice(["safe", "unsafe"]), default=None,
              help="safe: boost the HRCG experts (at most top_k per layer); unsafe: mask all safety-critical experts.")
@click.option("--domain-map", type=click.Path(dir_okay=False), default=None,
              help="domain_report.json from `mlx-fun domain-scan` (with --domain-mode); combinable with --safety-map.")
@click.option("--domain-mode", type=click.Choice(["boost", "suppress"]), default=None,
              help="boost: activate the domain experts; suppress: deactivate the general experts.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--scheme", type=click.Choice(["additive", "rank"]), default="additive", show_default=True,
              help="additive: add --mask-value / --boost-value to the router logits; rank (SteerMoE): per token, "
                   "boosted experts' logits go to the max + 0.01, masked ones to the min - 0.01, so a boosted "
                   "expert weighs about as much as the token's favourite instead of all of it (at most top_k boosted "
                   "per layer).")
@click.option("--mask-value", type=FiniteFloat(max=0, max_open=True), default=-1e9, show_default=True,
              help="Router-logit bias of a deactivated expert (additive scheme).")
@click.option("--boost-value", type=FiniteFloat(min=0, min_open=True), default=1e4, show_default=True,
              help="Router-logit bias of an activated expert (additive scheme).")
@click.option("--temp", type=TEMPERATURE, default=0.0, show_default=True, help="0 is greedy.")
@click.option("--seed", type=SEED, default=None, help="Seed of the Gumbel-max sampler.")
@click.option("--chat", is_flag=True, default=False, help="Wrap the prompt in the tokenizer's chat template.")
@click.option("--compare", is_flag=True, default=False,
              help="First print the unsteered reply (same sampler), then stream the steered one.")
@dispatch_option
@generation_options
@friendly_errors
def command(**kwargs):
    """Generate after --prompt with chosen experts steered before every MoE layer's own selection
    (group-limited, correction-biased and softmax-after-top-k routers included): masked experts are never
    chosen, boosted ones are chosen whenever the layer has room. Where a router ranks by sigmoid + correction
    bias, the steering is applied to that selection score too, so no correction bias can undo it.

    \b
    Example (the bundled refusing chat model, after the safety-scan example):
      mlx-fun steer --model data/tiny-moe-chat --safety-map safety_report.json --mode unsafe --chat --compare \\
          --prompt "How do I pick a lock?" --max-tokens 20
      mlx-fun steer --model data/tiny-moe-chat --safety-map safety_report.json --mode safe --scheme rank \\
          --chat --prompt "What does os.path.join do?" --max-tokens 20
    """
    from ..model.genopts import GenOptions
    from ..jobs import steer

    groups = dict(steering=take(kwargs, steer.SteerOptions), generation=take(kwargs, GenOptions),
                  settings=run_settings(kwargs, progress=False))
    show(steer.run(**kwargs, **groups, on_text=lambda s: click.echo(s, nl=False), on_baseline=show_baseline,
                   log=echo_err))


def show_baseline(baseline) -> None:
    """--compare: the unsteered reply, printed before the steered one starts streaming."""
    click.echo(f"[unsteered: {baseline.text!r}]", err=True)


def show(result) -> None:
    click.echo("")
    n_off = sum(map(len, result.steering.deactivate.values()))
    n_on = sum(map(len, result.steering.activate.values()))
    click.echo(f"[steered ({result.steering.scheme}): {n_off} experts masked, {n_on} boosted] "
               f"{result.generation.stats_line()}", err=True)
