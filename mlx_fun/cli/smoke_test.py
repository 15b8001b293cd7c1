"""``mlx-fun smoke-test``: generate a few tokens from a model with mlx-lm's KV cache and our Gumbel sampler."""

from __future__ import annotations

import click

from ..errors import UserError
from .common import FiniteFloat, dispatch_option, friendly_errors, model_option

DEFAULT_PROMPT = "def fibonacci(n):"


def check_generatable(model_path: str) -> dict:
    """Fail fast (before loading weights) on a missing model or a ``model_type`` mlx-lm cannot build."""
    from mlx_lm.utils import _get_classes

    from ..io import read_config

    config = read_config(model_path)
    if "model_type" not in config:
        raise UserError(f"{model_path}/config.json has no model_type; --model must be an mlx-lm model directory.")
    try:
        _get_classes(config)
    except ValueError:
        raise UserError(
            f"model_type '{config['model_type']}' of {model_path} is not supported by the installed mlx-lm; "
            f"upgrade mlx-lm or convert the model to a supported architecture."
        ) from None
    return config


@click.command("smoke-test", short_help="Generate text from a model (greedy or seeded Gumbel sampling), with tok/s.")
@model_option
@click.option("--prompt", default=DEFAULT_PROMPT, show_default=True,
              help="Prompt text, fed raw (no chat template) unless --chat.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=100, show_default=True,
              help="Generate at most this many tokens (fewer when the model emits an EOS token).")
@click.option("--temp", type=FiniteFloat(min=0.0), default=0.0, show_default=True,
              help="Sampling temperature; 0 is greedy (exact argmax, identical to mlx_lm.generate's default).")
@click.option("--seed", type=click.IntRange(min=0), default=None,
              help="Seed: step n of the generation draws its noise from mx.random.key(seed + n), so the same "
                   "seed reproduces the output. Without it the noise comes from MLX's global RNG.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True,
              help="Sample only among the k most likely tokens (0 disables).")
@click.option("--top-p", type=FiniteFloat(min=0.0, max=1.0, min_open=True), default=1.0, show_default=True,
              help="Sample only from the nucleus of the model's (untempered) distribution holding this much "
                   "probability (1 disables).")
@click.option("--chat", is_flag=True, default=False,
              help="Wrap the prompt in the tokenizer's chat template (one user turn + the generation prompt).")
@dispatch_option
@friendly_errors
def smoke_test_cmd(model, prompt, max_tokens, temp, seed, top_k, top_p, chat, dispatch):
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
    from ..io import context_length, load_model
    from ..sampling import encode_prompt, make_sampler, run_generation

    config = check_generatable(model)
    if not prompt:
        raise UserError("--prompt is empty; pass some text to continue.")

    click.echo(f"Loading {model} ...", err=True)
    mdl, tokenizer, _config = load_model(model)
    dispatch.apply(mdl, echo=lambda line: click.echo(line, err=True))
    sampler = make_sampler(temp=temp, seed=seed, top_k=top_k, top_p=top_p)
    click.echo(f"Sampler: {sampler!r}", err=True)

    ids = encode_prompt(tokenizer, prompt, chat)
    limit = context_length(config)
    if limit and len(ids) + max_tokens > limit:
        click.echo(f"Warning: the prompt ({len(ids):,} tokens) plus --max-tokens {max_tokens:,} is longer than the "
                   f"model's context of {limit:,} tokens (max_position_embeddings); output past it is unreliable. "
                   f"Shorten the prompt or lower --max-tokens.", err=True)
    result = run_generation(
        mdl, tokenizer, ids, max_tokens=max_tokens, temp=temp, seed=seed, top_k=top_k, top_p=top_p, chat=chat,
        on_text=lambda s: click.echo(s, nl=False),
    )
    click.echo("")
    if result.finish_reason == "stop":
        click.echo("[stopped at an EOS token]", err=True)
    click.echo(result.stats_line())


COMMANDS = [smoke_test_cmd]
