"""The ``smoke-test`` job: generate from a model as ``mlx_lm.generate`` does — its flags, its prompt (the chat
template by default), its KV cache — with mlx-fun's expert dispatch and Gumbel-max sampler (greedy: mlx-lm's
tokens)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Callable

import click

from ..core.options import Opt
from ..errors import UserError, param
from ..model.chat import ChatOptions
from ..model.genopts import DRAFT_MODEL, MAX_NEW_TOKENS, TRUST_REMOTE_CODE, GenOptions, Sampling
from ..model.lora import ADAPTER_PATH
from ..settings import RunSettings
from .common import MODEL, Log, job, quiet

#: mlx_lm.generate's default prompt and prefill step
DEFAULT_PROMPT = "hello"
DEFAULT_PREFILL_STEP_SIZE = 2048
PROMPT = Opt("Message to be processed by the model: the user turn of the chat template, or the raw text with "
             "--ignore-chat-template or a tokenizer without one ('-' reads standard input; \\n and \\t become a "
             "newline and a tab, as in mlx_lm.generate).", aliases=("-p",))
VERBOSE = Opt("True: status lines, the text as it is generated and the speeds; False: only the generated text (as "
              "mlx_lm.generate's --verbose).", type=click.BOOL)
PREFILL_STEP_SIZE = Opt("Prompt tokens fed per forward while prefilling (fewer lower the peak memory); "
                        "--token-budget lowers it further.", type=click.IntRange(min=1))


@dataclass
class SmokeTestResult:
    generation: object  # mlx_fun.model.sampling.GenerationResult: tokens, text, prompt/generation tok/s, finish_reason
    sampler: str
    warnings: list[str] = field(default_factory=list)


def check_generatable(model_path, *, trust_remote_code: bool = False) -> dict:
    """Fail fast (before loading weights) on a missing model or a ``model_type`` mlx-lm cannot build (a config
    naming its own ``model_file`` builds with ``trust_remote_code``)."""
    from .. import mlx_lm_compat
    from ..model.io import read_config

    config = read_config(model_path)
    if "model_type" not in config:
        raise UserError(f"{model_path}/config.json has no model_type; {param('model')} must be an mlx-lm model "
                        f"directory.")
    if trust_remote_code and config.get("model_file"):
        return config
    try:
        mlx_lm_compat.model_classes(config)
    except ValueError:
        raise UserError(
            f"model_type '{config['model_type']}' of {model_path} is not supported by the installed mlx-lm; "
            f"upgrade mlx-lm or convert the model to a supported architecture."
        ) from None
    return config


@job(any_model=True)
def run(
    *,
    model: Annotated[str | Path, MODEL],
    adapter_path: Annotated[str | Path | None, ADAPTER_PATH] = None,
    trust_remote_code: Annotated[bool, TRUST_REMOTE_CODE] = False,
    prompt: Annotated[str, PROMPT] = DEFAULT_PROMPT,
    chat: ChatOptions = ChatOptions(),
    max_tokens: Annotated[int, MAX_NEW_TOKENS] = 100,
    sampling: Sampling = Sampling(),
    verbose: Annotated[bool, VERBOSE] = True,
    prefill_step_size: Annotated[int, PREFILL_STEP_SIZE] = DEFAULT_PREFILL_STEP_SIZE,
    settings: RunSettings = RunSettings(),
    generation: GenOptions = GenOptions(),
    draft_model: Annotated[str | Path | None, DRAFT_MODEL] = None,
    on_text: Callable[[str], None] | None = None,
    log: Log = quiet,
) -> SmokeTestResult:
    """Generate up to ``max_tokens`` after ``prompt`` as ``mlx_lm.generate`` does with the same options: the prompt
    in the tokenizer's chat template when it has one (``chat``: :class:`mlx_fun.model.chat.ChatOptions`, the system
    prompt, a prefilled reply, template arguments, extra EOS tokens, or the raw text), then greedy at ``temp=0``
    (token for token mlx-lm's), else seeded Gumbel-max sampling (``sampling``: temperature, seed, top-k, top-p,
    min-p, XTC). ``on_text`` receives the text as it is generated; ``verbose=False`` silences ``log``.
    ``adapter_path``: a LoRA adapter fused into the model as it loads (:mod:`mlx_fun.model.lora`);
    ``trust_remote_code``: mlx-lm's. ``settings`` (:class:`mlx_fun.settings.RunSettings`): the expert dispatch, and
    ``token_budget`` (when given) as the most prompt tokens prefilled per forward, below ``prefill_step_size``; its
    ``progress`` is unused. ``generation`` / ``draft_model``: mlx-lm's KV-cache and speculative decoding options
    (:mod:`mlx_fun.model.genopts`)."""
    from ..model import lora, moe_hook
    from ..model.chat import add_eos_tokens, prompt_ids
    from ..model.genopts import load_draft
    from ..model.io import context_length, load_model
    from ..model.sampling import run_generation, sampler_of

    log = log if verbose else quiet
    generation.check(draft=draft_model)
    config = check_generatable(model, trust_remote_code=trust_remote_code)
    if adapter_path is not None:
        lora.check(adapter_path)
    if not prompt:
        raise UserError(f"{param('prompt')} is empty; pass some text to continue.")
    log(f"Loading {model}" + ("" if adapter_path is None else f" with the adapter {adapter_path} fused") + " ...")
    mdl, tokenizer, _config = load_model(model, adapter_path=adapter_path, trust_remote_code=trust_remote_code)
    if (line := lora.note(mdl)) is not None:
        log(f"Note: {line}")
    add_eos_tokens(tokenizer, chat.extra_eos_token)
    ids = prompt_ids(tokenizer, prompt, chat)
    report = settings.apply(mdl, log=log)
    if report.mode == "auto":
        moe_hook.for_generation(mdl, _config)  # decode steps run one compiled graph per MoE block
    if draft_model is not None:
        log(f"Loading the draft model {draft_model} ...")
    draft = load_draft(draft_model, tokenizer)
    log(f"Sampler: {sampler_of(sampling)!r}")
    warnings = _past_context(len(ids), max_tokens, context_length(config), log)
    budget = settings.prefill_step(config, dispatch_mode=report.mode)
    result = run_generation(mdl, tokenizer, ids, max_tokens=max_tokens, sampling=sampling, on_text=on_text,
                            options=generation, draft_model=draft,
                            prefill_step_size=min(prefill_step_size, budget or prefill_step_size))
    return SmokeTestResult(result, repr(sampler_of(sampling)), warnings)


def _past_context(n_prompt: int, max_tokens: int, limit: int | None, log: Log) -> list[str]:
    """A warning when the prompt and ``max_tokens`` run past the model's context."""
    if not limit or n_prompt + max_tokens <= limit:
        return []
    line = (f"the prompt ({n_prompt:,} tokens) plus {param('max_tokens')} {max_tokens:,} is longer than the model's "
            f"context of {limit:,} tokens (max_position_embeddings); output past it is unreliable. Shorten the prompt "
            f"or lower {param('max_tokens')}.")
    log(f"Warning: {line}")
    return [line]
