"""``mlx-fun smoke-test``: parses, calls :func:`mlx_fun.jobs.smoke_test.run` (text streamed), prints."""

from __future__ import annotations

import sys

import click

from ..jobs import smoke_test
from .common import echo_err, friendly_errors
from .options import job_kwargs, job_options


@click.command("smoke-test", short_help="Generate text as mlx_lm.generate does (its flags), with tok/s.")
@job_options(smoke_test.run)
@friendly_errors
def command(**kwargs):
    """Load MODEL and generate up to --max-tokens tokens after --prompt as `mlx_lm.generate` does with the same
    flags: the prompt goes into the tokenizer's chat template when it has one (--system-prompt,
    --prefill-response, --chat-template-config; --ignore-chat-template feeds it raw, with a BOS token when the
    tokenizer has one), then mlx-lm's KV cache (`stream_generate`) with mlx-fun's Gumbel-max sampler:
    token = argmax(logits / T + g), g = -log(-log(u)), u keyed by --seed and the step.

    --temp 0 (the default) is greedy decoding, token for token what mlx_lm.generate produces with the same flags;
    --seed is ignored then. --top-k / --top-p / --min-p / --xtc-probability mask the logits before the noise, in
    mlx-lm's order. --adapter-path fuses a LoRA adapter into the weights as they load.

    Prints the generated text, then one line: prompt tokens, generated tokens, prompt tok/s, generation tok/s
    (--verbose False: the text alone). The MoE experts run with mlx-fun's runtime dispatch (--dispatch auto:
    sorted or not, blocked, dequantized, per token count from measured cut-offs; same greedy tokens);
    --dispatch mlx-lm keeps mlx-lm's fixed rule.

    \b
    Example:
      mlx-fun smoke-test --model runs/pruned --prompt "def fibonacci(n):" --max-tokens 50 --temp 0.7 --seed 1
    """
    kwargs = job_kwargs(smoke_test.run, kwargs)
    prompt = kwargs["prompt"].replace("\\n", "\n").replace("\\t", "\t")  # as mlx_lm.generate reads --prompt
    kwargs["prompt"] = sys.stdin.read() if prompt == "-" else prompt
    verbose = kwargs["verbose"]
    show(smoke_test.run(**kwargs, on_text=lambda s: click.echo(s, nl=False), log=echo_err), verbose=verbose)


def show(result, *, verbose: bool = True) -> None:
    """The text was streamed while it was generated; close its line and print the speeds (``verbose``)."""
    click.echo("")
    if not verbose:
        return
    if result.generation.finish_reason == "stop":
        click.echo("[stopped at an EOS token]", err=True)
    click.echo(result.generation.stats_line())
