"""``mlx-fun smoke-test``: parses, calls :func:`mlx_fun.jobs.smoke_test.run` (text streamed), prints."""

from __future__ import annotations

import click

from ..jobs.smoke_test import DEFAULT_PROMPT
from .common import (
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    dispatch_option,
    echo_err,
    friendly_errors,
    generation_options,
    model_option,
    run_settings,
    take,
)


@click.command("smoke-test", short_help="Generate text from a model (greedy or seeded Gumbel sampling), with tok/s.")
@model_option
@click.option("--prompt", default=DEFAULT_PROMPT, show_default=True,
              help="Prompt text, fed raw (no chat template) unless --chat.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=100, show_default=True,
              help="Generate at most this many tokens (fewer when the model emits an EOS token).")
@click.option("--temp", type=TEMPERATURE, default=0.0, show_default=True,
              help="Sampling temperature; 0 is greedy (exact argmax, identical to mlx_lm.generate's default).")
@click.option("--seed", type=SEED, default=None,
              help="Seed: step n of the generation draws its noise from mx.random.key(seed + n), so the same "
                   "seed reproduces the output. Without it the noise comes from MLX's global RNG.")
@click.option("--top-k", type=TOP_K, default=0, show_default=True,
              help="Sample only among the k most likely tokens (0 disables).")
@click.option("--top-p", type=TOP_P, default=1.0, show_default=True,
              help="Sample only from the nucleus of the model's (untempered) distribution holding this much "
                   "probability (1 disables).")
@click.option("--chat", is_flag=True, default=False,
              help="Wrap the prompt in the tokenizer's chat template (one user turn + the generation prompt).")
@dispatch_option
@generation_options
@friendly_errors
def command(**kwargs):
    """Load MODEL and generate up to --max-tokens tokens after --prompt, using mlx-lm's KV cache
    (`stream_generate`) with mlx-fun's Gumbel-max sampler: token = argmax(logits / T + g), g = -log(-log(u)).

    The prompt is fed raw (no chat template; a BOS token is added when the tokenizer has one, as
    mlx_lm.generate does); pass --chat to apply the tokenizer's chat template instead. --temp 0 (the default)
    is greedy decoding, token for token what mlx_lm.generate produces; --seed is ignored then. --top-k/--top-p
    mask the logits before the noise.

    Prints the generated text, then one line: prompt tokens, generated tokens, prompt tok/s, generation tok/s.
    The MoE experts run with mlx-fun's runtime dispatch (--dispatch auto: sorted or not, blocked, dequantized,
    per token count from measured cut-offs; same greedy tokens); --dispatch mlx-lm keeps mlx-lm's fixed rule.

    \b
    Example:
      mlx-fun smoke-test --model pruned --prompt "def fibonacci(n):" --max-tokens 50 --temp 0.7 --seed 1
    """
    from ..model.genopts import GenOptions
    from ..jobs import smoke_test

    groups = dict(generation=take(kwargs, GenOptions), settings=run_settings(kwargs, progress=False))
    show(smoke_test.run(**kwargs, **groups, on_text=lambda s: click.echo(s, nl=False), log=echo_err))


def show(result) -> None:
    """The text was streamed while it was generated; close its line and print the speeds."""
    click.echo("")
    if result.generation.finish_reason == "stop":
        click.echo("[stopped at an EOS token]", err=True)
    click.echo(result.generation.stats_line())
