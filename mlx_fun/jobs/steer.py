"""The ``steer`` job: generate with experts forced off or on (SteerMoE router-logit steering)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Callable

import click

from ..core.options import Group, Opt, option
from ..core.ranges import FiniteFloat
from ..errors import UserError, param
from ..experts.steer_options import BOOST_EXPERTS, BOOST_EXPERTS_DEFAULT, SAFETY_MODE, SCHEME, SCHEME_DEFAULT
from ..model.genopts import CHAT, DRAFT_MODEL, MAX_NEW_TOKENS, GenOptions, Sampling
from ..model.lora import ADAPTER_PATH
from ..settings import RunSettings
from .common import MODEL, Log, check_supported, job, load_moe, quiet


@dataclass(frozen=True)
class SteerOptions(Group):
    """What is steered and how: a safety report (``safety_map``, from ``safety-scan``) with ``mode`` ``safe``
    (activate ``boost_experts`` of its HCDG experts) or ``unsafe`` (deactivate them all), and/or a domain report
    (``domain_map``, from ``domain-scan``) with ``domain_mode`` ``boost`` / ``suppress``; ``scheme`` ``rank``
    (SteerMoE, the default: to the token's max + 0.01 / min - 0.01) or ``additive`` (add ``mask_value`` /
    ``boost_value`` to the router logits). The rules are :mod:`mlx_fun.experts.steering`'s. Field names are
    ``mlx-fun steer``'s options."""

    safety_map: str | Path | None = option(
        None, "safety_report.json from `mlx-fun safety-scan` (with --mode).", type=click.Path(dir_okay=False),
        missing="pass a safety_report.json written by `mlx-fun safety-scan`")
    mode: str | None = option(None, SAFETY_MODE.help, type=SAFETY_MODE.type)
    domain_map: str | Path | None = option(
        None, "domain_report.json from `mlx-fun domain-scan` (with --domain-mode); combinable with --safety-map.",
        type=click.Path(dir_okay=False), missing="pass a domain_report.json written by `mlx-fun domain-scan`")
    domain_mode: str | None = option(
        None, "boost: activate --boost-experts of the domain experts; suppress: deactivate the general experts.",
        type=click.Choice(["boost", "suppress"]))
    mask_value: float = option(-1e9, "Router-logit bias of a deactivated expert (additive scheme).",
                               type=FiniteFloat(max=0, max_open=True))
    boost_value: float = option(1e4, "Router-logit bias of an activated expert (additive scheme).",
                                type=FiniteFloat(min=0, min_open=True))
    scheme: str = option(SCHEME_DEFAULT, SCHEME.help, type=SCHEME.type)
    boost_experts: int = option(BOOST_EXPERTS_DEFAULT, BOOST_EXPERTS.help, type=BOOST_EXPERTS.type)


@dataclass
class SteerResult:
    steering: object  # mlx_fun.experts.steering.Steering
    generation: object  # mlx_fun.model.sampling.GenerationResult
    baseline: object | None = None  # the unsteered generation (compare=True)
    warnings: list[str] = field(default_factory=list)


@job
def run(
    *,
    model: Annotated[str | Path, MODEL],
    adapter_path: Annotated[str | Path | None, ADAPTER_PATH] = None,
    prompt: Annotated[str, Opt("Prompt text (raw unless --chat).", required=True)],
    steering: SteerOptions = SteerOptions(),
    max_tokens: Annotated[int, MAX_NEW_TOKENS] = 100,
    sampling: Sampling = Sampling(),
    chat: Annotated[bool, CHAT] = False,
    compare: Annotated[bool, Opt("First print the unsteered reply (same sampler), then stream the steered "
                                 "one.")] = False,
    settings: RunSettings = RunSettings(),
    generation: GenOptions = GenOptions(),
    draft_model: Annotated[str | Path | None, DRAFT_MODEL] = None,
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
    speculative decoding options (:mod:`mlx_fun.model.genopts`); a draft model is never steered. ``adapter_path``:
    a LoRA adapter fused into the model as it loads (:mod:`mlx_fun.model.lora`)."""
    from ..model import moe_hook
    from ..model.genopts import load_draft
    from ..model.sampling import encode_prompt, run_generation
    from ..experts.steering import for_adapter

    generation.check(draft=draft_model)
    check_supported(model)
    s = steering
    if s.safety_map is None and s.domain_map is None:
        raise UserError(f"nothing to steer: pass {param('safety_map')} with {param('mode')} and/or "
                        f"{param('domain_map')} with {param('domain_mode')}.")
    if not prompt:
        raise UserError(f"{param('prompt')} is empty; pass the text to answer.")
    if adapter_path is not None:
        from ..model import lora

        lora.check(adapter_path)
    mdl, tokenizer, config, adapter = load_moe(model, log=log, adapter_path=adapter_path)
    steers = for_adapter(adapter, safety_map=s.safety_map, safety_mode=s.mode, domain_map=s.domain_map,
                         domain_mode=s.domain_mode, mask_value=s.mask_value, boost_value=s.boost_value,
                         scheme=s.scheme, boost_experts=s.boost_experts,
                         field_names={"safety_map": param("safety_map"), "safety_mode": param("mode"),
                                      "domain_map": param("domain_map"), "domain_mode": param("domain_mode"),
                                      "mask_value": param("mask_value"), "boost_value": param("boost_value"),
                                      "scheme": param("scheme"), "boost_experts": param("boost_experts")})
    for w in steers.warnings:
        log(f"Warning: {w}")
    report = settings.apply(mdl, log=log)
    draft = load_draft(draft_model, tokenizer)
    gen = dict(max_tokens=max_tokens, sampling=sampling, options=generation, draft_model=draft,
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

