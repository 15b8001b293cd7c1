"""The ``smoke-test`` job: generate from a model with mlx-lm's KV cache and mlx-fun's Gumbel-max sampler."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import UserError, param
from .common import Log, apply_dispatch, quiet

DEFAULT_PROMPT = "def fibonacci(n):"


@dataclass
class SmokeTestResult:
    generation: object  # mlx_fun.sampling.GenerationResult: tokens, text, prompt/generation tok/s, finish_reason
    sampler: str
    warnings: list[str] = field(default_factory=list)


def check_generatable(model_path) -> dict:
    """Fail fast (before loading weights) on a missing model or a ``model_type`` mlx-lm cannot build."""
    from .. import mlx_lm_compat
    from ..io import read_config

    _get_classes = mlx_lm_compat.get("smoke-test", "mlx_lm.utils", "_get_classes")

    config = read_config(model_path)
    if "model_type" not in config:
        raise UserError(f"{model_path}/config.json has no model_type; {param('model')} must be an mlx-lm model "
                        f"directory.")
    try:
        _get_classes(config)
    except ValueError:
        raise UserError(
            f"model_type '{config['model_type']}' of {model_path} is not supported by the installed mlx-lm; "
            f"upgrade mlx-lm or convert the model to a supported architecture."
        ) from None
    return config


def run(
    *,
    model: str | Path,
    prompt: str = DEFAULT_PROMPT,
    max_tokens: int = 100,
    temp: float = 0.0,
    seed: int | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
    chat: bool = False,
    dispatch: str = "auto",
    dispatch_table: str | Path | None = None,
    dequant_cache: int | str = 0,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 5000,
    max_kv_size: int | None = None,
    draft_model: str | Path | None = None,
    num_draft_tokens: int = 2,
    on_text: Callable[[str], None] | None = None,
    log: Log = quiet,
) -> SmokeTestResult:
    """Generate up to ``max_tokens`` after ``prompt`` (raw, or in the chat template with ``chat``): greedy at
    ``temp=0`` (token for token what ``mlx_lm.generate`` gives), else seeded Gumbel-max sampling. ``on_text``
    receives the text as it is generated. ``kv_bits`` … ``num_draft_tokens``: mlx-lm's KV-cache and speculative
    decoding options (:mod:`mlx_fun.genopts`)."""
    from ..genopts import GenOptions, load_draft
    from ..io import context_length, load_model
    from ..sampling import encode_prompt, make_sampler, run_generation

    options = GenOptions(kv_bits, kv_group_size, quantized_kv_start, max_kv_size, num_draft_tokens).check(
        draft=draft_model)
    config = check_generatable(model)
    if not prompt:
        raise UserError(f"{param('prompt')} is empty; pass some text to continue.")
    try:
        sampler = make_sampler(temp=temp, seed=seed, top_k=top_k, top_p=top_p)
    except ValueError as e:
        raise UserError(f"{e}; check {param('temp')}, {param('seed')}, {param('top_k')} and {param('top_p')}.") from None
    log(f"Loading {model} ...")
    mdl, tokenizer, _config = load_model(model)
    apply_dispatch(mdl, dispatch=dispatch, dispatch_table=dispatch_table, dequant_cache=dequant_cache, log=log)
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
    result = run_generation(mdl, tokenizer, ids, max_tokens=max_tokens, temp=temp, seed=seed, top_k=top_k,
                            top_p=top_p, chat=chat, on_text=on_text, options=options, draft_model=draft)
    return SmokeTestResult(result, repr(sampler), warnings)
