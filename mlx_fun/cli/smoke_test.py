"""``mlx-fun smoke-test``: parses, calls :func:`mlx_fun.jobs.smoke_test.run` (text streamed), prints."""

from __future__ import annotations

import click

from ..jobs import smoke_test
from .common import echo_err, friendly_errors
from .options import job_kwargs, job_options


@click.command("smoke-test", short_help="Generate text from a model (greedy or seeded Gumbel sampling), with tok/s.")
@job_options(smoke_test.run)
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
    kwargs = job_kwargs(smoke_test.run, kwargs)
    show(smoke_test.run(**kwargs, on_text=lambda s: click.echo(s, nl=False), log=echo_err))


def show(result) -> None:
    """The text was streamed while it was generated; close its line and print the speeds."""
    click.echo("")
    if result.generation.finish_reason == "stop":
        click.echo("[stopped at an EOS token]", err=True)
    click.echo(result.generation.stats_line())
