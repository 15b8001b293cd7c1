"""The ``steer`` job: generate with experts forced off or on (SteerMoE router-logit steering)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import UserError, param, require_path
from ..model.genopts import GenOptions
from ..settings import RunSettings
from .common import Log, check_supported, load_moe, quiet


@dataclass(frozen=True)
class SteerOptions:
    """What is steered and how: a safety report (``safety_map``, from ``safety-scan``) with ``mode`` ``safe`` (boost
    its HRCG experts, at most top_k per layer) or ``unsafe`` (mask its safety-critical experts), and/or a domain
    report (``domain_map``, from ``domain-scan``) with ``domain_mode`` ``boost`` / ``suppress``; ``scheme``
    ``additive`` (add ``mask_value`` / ``boost_value`` to the router logits) or ``rank`` (SteerMoE: to the token's
    max + 0.01 / min - 0.01). Field names are ``mlx-fun steer``'s options."""

    safety_map: str | Path | None = None
    mode: str | None = None
    domain_map: str | Path | None = None
    domain_mode: str | None = None
    mask_value: float = -1e9
    boost_value: float = 1e4
    scheme: str = "additive"


@dataclass
class SteerResult:
    steering: object  # mlx_fun.experts.steering.Steering
    generation: object  # mlx_fun.model.sampling.GenerationResult
    baseline: object | None = None  # the unsteered generation (compare=True)
    warnings: list[str] = field(default_factory=list)


def run(
    *,
    model: str | Path,
    prompt: str,
    steering: SteerOptions = SteerOptions(),
    max_tokens: int = 100,
    temp: float = 0.0,
    seed: int | None = None,
    chat: bool = False,
    compare: bool = False,
    settings: RunSettings = RunSettings(),
    generation: GenOptions = GenOptions(),
    draft_model: str | Path | None = None,
    on_text: Callable[[str], None] | None = None,
    on_baseline: Callable[[object], None] | None = None,
    log: Log = quiet,
) -> SteerResult:
    """Generate after ``prompt`` with the router steering of ``steering`` (:class:`SteerOptions`: which reports,
    which modes, which scheme), through the hooked MoE call of every family. ``compare`` first generates without
    steering (same sampler, same seed) and hands that generation to ``on_baseline`` before the steered one starts
    (whose text goes to ``on_text`` as it is produced). ``settings`` (:class:`mlx_fun.settings.RunSettings`): the
    expert dispatch, and ``token_budget`` (when given) as the most prompt tokens mlx-lm prefills per forward; its
    ``progress`` is unused (generation shows no bar). ``generation`` / ``draft_model``: mlx-lm's KV-cache and
    speculative decoding options (:mod:`mlx_fun.model.genopts`); a draft model is never steered."""
    from ..model import moe_hook
    from ..model.genopts import load_draft
    from ..model.sampling import encode_prompt, make_sampler, run_generation
    from ..experts.steering import for_adapter

    generation.check(draft=draft_model)
    settings.check()
    check_supported(model)
    s = steering
    if s.safety_map is None and s.domain_map is None:
        raise UserError(f"nothing to steer: pass {param('safety_map')} with {param('mode')} and/or "
                        f"{param('domain_map')} with {param('domain_mode')}.")
    require_path("safety_map", s.safety_map, "pass a safety_report.json written by `mlx-fun safety-scan`")
    require_path("domain_map", s.domain_map, "pass a domain_report.json written by `mlx-fun domain-scan`")
    if not prompt:
        raise UserError(f"{param('prompt')} is empty; pass the text to answer.")
    try:
        make_sampler(temp=temp, seed=seed)
    except ValueError as e:
        raise UserError(f"{e}; check {param('temp')} and {param('seed')}.") from None
    mdl, tokenizer, config, adapter = load_moe(model, log=log)
    steers = for_adapter(adapter, safety_map=s.safety_map, safety_mode=s.mode, domain_map=s.domain_map,
                         domain_mode=s.domain_mode, mask_value=s.mask_value, boost_value=s.boost_value,
                         scheme=s.scheme,
                         field_names={"safety_map": param("safety_map"), "safety_mode": param("mode"),
                                      "domain_map": param("domain_map"), "domain_mode": param("domain_mode"),
                                      "mask_value": param("mask_value"), "boost_value": param("boost_value"),
                                      "scheme": param("scheme")})
    for w in steers.warnings:
        log(f"Warning: {w}")
    report = settings.apply(mdl, log=log)
    draft = load_draft(draft_model, tokenizer)
    gen = dict(max_tokens=max_tokens, temp=temp, seed=seed, options=generation, draft_model=draft,
               prefill_step_size=settings.prefill_step(config, dispatch_mode=report.mode, top_k=adapter.top_k))
    ids = encode_prompt(tokenizer, prompt, chat)
    baseline = None
    if compare:
        baseline = run_generation(mdl, tokenizer, ids, **gen)
        if on_baseline is not None:
            on_baseline(baseline)
    with moe_hook.hooked(adapter, [], steers.route_steers(adapter)):
        generation_result = run_generation(mdl, tokenizer, ids, **gen, on_text=on_text)
    return SteerResult(steers, generation_result, baseline, list(steers.warnings))

