"""The ``smoke-test`` job: generate from a model with mlx-lm's KV cache and mlx-fun's Gumbel-max sampler."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Callable

from ..core.options import Opt
from ..errors import UserError, param
from ..model.genopts import CHAT, DRAFT_MODEL, MAX_NEW_TOKENS, GenOptions, Sampling
from ..settings import RunSettings
from .common import MODEL, Log, job, quiet

DEFAULT_PROMPT = "def fibonacci(n):"


@dataclass
class SmokeTestResult:
    generation: object  # mlx_fun.model.sampling.GenerationResult: tokens, text, prompt/generation tok/s, finish_reason
    sampler: str
    warnings: list[str] = field(default_factory=list)


def check_generatable(model_path) -> dict:
    """Fail fast (before loading weights) on a missing model or a ``model_type`` mlx-lm cannot build."""
    from .. import mlx_lm_compat
    from ..model.io import read_config

    config = read_config(model_path)
    if "model_type" not in config:
        raise UserError(f"{model_path}/config.json has no model_type; {param('model')} must be an mlx-lm model "
                        f"directory.")
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
    prompt: Annotated[str, Opt("Prompt text, fed raw (no chat template) unless --chat.")] = DEFAULT_PROMPT,
    max_tokens: Annotated[int, MAX_NEW_TOKENS] = 100,
    sampling: Sampling = Sampling(),
    chat: Annotated[bool, CHAT] = False,
    settings: RunSettings = RunSettings(),
    generation: GenOptions = GenOptions(),
    draft_model: Annotated[str | Path | None, DRAFT_MODEL] = None,
    on_text: Callable[[str], None] | None = None,
    log: Log = quiet,
) -> SmokeTestResult:
    """Generate up to ``max_tokens`` after ``prompt`` (raw, or in the chat template with ``chat``): greedy at
    ``temp=0`` (token for token what ``mlx_lm.generate`` gives), else seeded Gumbel-max sampling. ``on_text``
    receives the text as it is generated; ``sampling`` (:class:`mlx_fun.model.sampling.Sampling`): temperature,
    seed, top-k, top-p. ``settings`` (:class:`mlx_fun.settings.RunSettings`): the expert dispatch,
    and ``token_budget`` (when given) as the most prompt tokens mlx-lm prefills per forward; its ``progress`` is
    unused (generation shows no bar). ``generation`` / ``draft_model``: mlx-lm's KV-cache and speculative decoding
    options (:mod:`mlx_fun.model.genopts`)."""
    from ..model import moe_hook
    from ..model.genopts import load_draft
    from ..model.io import context_length, load_model
    from ..model.sampling import encode_prompt, run_generation, sampler_of

    generation.check(draft=draft_model)
    config = check_generatable(model)
    if not prompt:
        raise UserError(f"{param('prompt')} is empty; pass some text to continue.")
    sampler = sampler_of(sampling)
    log(f"Loading {model} ...")
    mdl, tokenizer, _config = load_model(model)
    report = settings.apply(mdl, log=log)
    if report.mode == "auto":
        moe_hook.for_generation(mdl, _config)  # decode steps run one compiled graph per MoE block
    if draft_model is not None:
        log(f"Loading the draft model {draft_model} ...")
    draft = load_draft(draft_model, tokenizer)
    log(f"Sampler: {sampler!r}")
    ids = encode_prompt(tokenizer, prompt, chat)
    limit, warnings = context_length(config), []
    if limit and len(ids) + max_tokens > limit:
        warnings.append(f"the prompt ({len(ids):,} tokens) plus {param('max_tokens')} {max_tokens:,} is longer than "
                        f"the model's context of {limit:,} tokens (max_position_embeddings); output past it is "
                        f"unreliable. Shorten the prompt or lower {param('max_tokens')}.")
        log(f"Warning: {warnings[-1]}")
    result = run_generation(mdl, tokenizer, ids, max_tokens=max_tokens, sampling=sampling, chat=chat,
                            on_text=on_text, options=generation, draft_model=draft,
                            prefill_step_size=settings.prefill_step(config, dispatch_mode=report.mode))
    return SmokeTestResult(result, repr(sampler), warnings)
