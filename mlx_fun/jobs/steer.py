"""The ``steer`` job: generate with experts forced off or on (SteerMoE router-logit steering)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import UserError, param
from .common import Log, apply_dispatch, check_supported, load_moe, quiet, require_path


@dataclass
class SteerResult:
    steering: object  # mlx_fun.steering.Steering
    generation: object  # mlx_fun.sampling.GenerationResult
    baseline: object | None = None  # the unsteered generation (compare=True)
    warnings: list[str] = field(default_factory=list)


def run(
    *,
    model: str | Path,
    prompt: str,
    safety_map: str | Path | None = None,
    mode: str | None = None,
    domain_map: str | Path | None = None,
    domain_mode: str | None = None,
    max_tokens: int = 100,
    mask_value: float = -1e9,
    boost_value: float = 1e4,
    scheme: str = "additive",
    temp: float = 0.0,
    seed: int | None = None,
    chat: bool = False,
    compare: bool = False,
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
    on_baseline: Callable[[object], None] | None = None,
    log: Log = quiet,
) -> SteerResult:
    """Generate after ``prompt`` with the router steering (``scheme`` additive or rank) of a safety report (``mode`` ``safe``: boost its
    HRCG experts, at most top_k per layer; ``unsafe``: mask its safety-critical experts) and/or a domain report
    (``domain_mode`` ``boost`` / ``suppress``), through the hooked MoE call of every family. ``compare`` first
    generates without steering (same sampler, same seed) and hands that generation to ``on_baseline`` before the
    steered one starts (whose text goes to ``on_text`` as it is produced). ``kv_bits`` … ``num_draft_tokens``:
    mlx-lm's KV-cache and speculative decoding options (:mod:`mlx_fun.genopts`); a draft model is never steered."""
    from .. import moe_hook
    from ..genopts import GenOptions, load_draft
    from ..sampling import encode_prompt, make_sampler, run_generation
    from ..steering import for_adapter

    options = GenOptions(kv_bits, kv_group_size, quantized_kv_start, max_kv_size, num_draft_tokens).check(
        draft=draft_model)
    check_supported(model)
    if safety_map is None and domain_map is None:
        raise UserError(f"nothing to steer: pass {param('safety_map')} with {param('mode')} and/or "
                        f"{param('domain_map')} with {param('domain_mode')}.")
    require_path("safety_map", safety_map, "pass a safety_report.json written by `mlx-fun safety-scan`")
    require_path("domain_map", domain_map, "pass a domain_report.json written by `mlx-fun domain-scan`")
    if not prompt:
        raise UserError(f"{param('prompt')} is empty; pass the text to answer.")
    try:
        make_sampler(temp=temp, seed=seed)
    except ValueError as e:
        raise UserError(f"{e}; check {param('temp')} and {param('seed')}.") from None
    mdl, tokenizer, _config, adapter = load_moe(model, log=log)
    steering = for_adapter(adapter, safety_map=safety_map, safety_mode=mode, domain_map=domain_map,
                           domain_mode=domain_mode, mask_value=mask_value, boost_value=boost_value, scheme=scheme,
                           field_names={"safety_map": param("safety_map"), "safety_mode": param("mode"),
                                        "domain_map": param("domain_map"), "domain_mode": param("domain_mode"),
                                        "mask_value": param("mask_value"), "boost_value": param("boost_value"),
                                        "scheme": param("scheme")})
    for w in steering.warnings:
        log(f"Warning: {w}")
    apply_dispatch(mdl, dispatch=dispatch, dispatch_table=dispatch_table, dequant_cache=dequant_cache, log=log)
    draft = load_draft(draft_model, tokenizer)
    gen = dict(max_tokens=max_tokens, temp=temp, seed=seed, options=options, draft_model=draft)
    ids = encode_prompt(tokenizer, prompt, chat)
    baseline = None
    if compare:
        baseline = run_generation(mdl, tokenizer, ids, **gen)
        if on_baseline is not None:
            on_baseline(baseline)
    with moe_hook.hooked(adapter, [], steering.route_steers(adapter)):
        generation = run_generation(mdl, tokenizer, ids, **gen, on_text=on_text)
    return SteerResult(steering, generation, baseline, list(steering.warnings))
