"""The ``abliterate`` job: remove the refusal directions from what the decoder layers write, measure what it did.

Capture (:mod:`mlx_fun.residual`) over the harmful prompts the model refuses and the benign ones it answers
(Arditi et al.'s filter, :func:`mlx_fun.refusal.is_refusal`) → per-layer directions → ``direction="single"``: the
one measured after ``direction_layer`` (default: the largest un-normalised difference), removed from every chosen
layer's residual writers and the token embedding; ``"per-layer"``: each layer's own → orthogonalisation
(:mod:`mlx_fun.rewrite.abliterate`). One mean difference describes the commonest way the model refuses, and a
model with several refusal phrasings keeps the others, so a round takes one direction per **phrasing** (the refused
prompts grouped by how their reply opens, :func:`mlx_fun.refusal.phrasing`; up to ``phrasings``, orthonormal), and
each further **round** measures them again on the model abliterated so far, from the prompts it still refuses,
and removes them too; a round that takes the capture benign prompts' first-token KL over ``max_kl`` is undone.
Every round starts from the original weights, so a quantized model is rounded once. Then the refusal rate on the
evaluation harmful prompts and the benign first-token KL against the original (:mod:`mlx_fun.refusal`), and the
model with ``abliteration_metadata.json`` beside it. ``search`` tries settings of (layers, weight, direction
layer), each measured after every round, and keeps the one with the fewest refusals under ``max_kl``.
A model that refuses none of the harmful capture prompts (or all the benign ones) has no refusal to remove: the
job stops there with the measured rates, nothing written, unless ``refusal_filter=False`` (every prompt, whatever
the model replies). Every phase logs what it does and, with ``progress``, shows a bar. The rounds, measuring and
search live in :mod:`mlx_fun.rewrite.abliterate_rounds`; this job checks the inputs, loads the model with the
expert dispatch and the token budget every forward keeps to, and writes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError, param, require_whole
from ..rewrite.abliterate_rounds import Abliteration, Round, Trial, candidates
from .common import Log, apply_dispatch, check_supported, forward_budget, load_moe, quiet, require_path


DIRECTIONS = ("single", "per-layer")


@dataclass
class AbliterateResult:
    output: Path
    layers: list[int]
    weight: float
    before: Trial  # the original model on the evaluation prompts
    after: Trial
    direction_norms: dict[str, float]
    directions: object  # (decoder layers, hidden) float64 unit directions: the first round's first (numpy)
    modified: dict[str, list[str]]
    trials: list[Trial] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    direction: str = "single"
    direction_layer: int | None = None
    rounds: list[Round] = field(default_factory=list)


def _check(*, layers, target, safety_map, weight, extraction_position, search, max_kl, eval_samples, direction,
           direction_layer, rounds, phrasings, dispatch="auto", token_budget=None) -> None:
    from ..residual import POSITIONS, parse_layers
    from ..rewrite.abliterate import TARGETS

    if target not in TARGETS:
        raise UserError(f"{param('target')} must be one of {', '.join(TARGETS)}, got {target!r}.")
    if target == "safety-experts":
        if safety_map is None:
            raise UserError(f"{param('target')} safety-experts needs {param('safety_map')}: a safety_report.json "
                            "from `mlx-fun safety-scan`.")
        require_path("safety_map", safety_map, "pass a safety_report.json written by `mlx-fun safety-scan`")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= 1:
        raise UserError(f"{param('weight')} must be in (0, 1], got {weight!r}.")
    if extraction_position not in POSITIONS:
        raise UserError(f"{param('extraction_position')} must be one of {', '.join(POSITIONS)}, "
                        f"got {extraction_position!r}.")
    if direction not in DIRECTIONS:
        raise UserError(f"{param('direction')} must be one of {', '.join(DIRECTIONS)}, got {direction!r}.")
    if direction_layer is not None and (isinstance(direction_layer, bool) or not isinstance(direction_layer, int)
                                        or direction_layer < 0):
        raise UserError(f"{param('direction_layer')} must be a decoder-layer index >= 0, got {direction_layer!r}.")
    for name, value, low in (("search", search, 0), ("rounds", rounds, 1), ("phrasings", phrasings, 1),
                             ("eval_samples", eval_samples, 1)):
        require_whole(name, value, low)
    if not (isinstance(max_kl, (int, float)) and math.isfinite(max_kl) and max_kl > 0):
        raise UserError(f"{param('max_kl')} must be a positive number, got {max_kl!r}.")
    parse_layers(layers, where=param("layers"))
    if dispatch not in ("auto", "mlx-lm"):
        raise UserError(f"{param('dispatch')} must be auto or mlx-lm, got {dispatch!r}.")
    require_whole("token_budget", token_budget, 1, none_ok=True)


def _check_distinct(harmful, benign) -> None:
    """The direction is harmful minus benign: the same prompts on both sides give none."""
    a, b = Path(harmful), Path(benign)
    same = a.resolve() == b.resolve() or (a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes())
    if same:
        raise UserError(f"{param('harmful_dataset')} {harmful} and {param('benign_dataset')} {benign} hold the same "
                        "prompts, so their difference (the refusal direction) is zero; pass prompts the model refuses "
                        "and prompts it answers.")


def _prompts(path, tokenizer, what: str, **kw) -> list[list[int]]:
    from ..data import load_samples

    samples = load_samples(path, tokenizer, generation_prompt=True, **kw)
    if not samples:
        raise UserError(f"{param(what)} {path} holds no prompts; give a JSONL of chats, prompts or text.")
    return samples


def run(
    *,
    model: str | Path,
    harmful_dataset: str | Path,
    benign_dataset: str | Path,
    output: str | Path,
    layers: str = "auto",
    target: str = "all",
    safety_map: str | Path | None = None,
    weight: float = 1.0,
    direction: str = "single",
    direction_layer: int | None = None,
    rounds: int = 2,
    phrasings: int = 4,
    max_samples: int = 128,
    max_tokens: int = 2048,
    extraction_position: str = "last",
    text_key: str = "content",
    seed: int | None = None,
    eval_harmful_dataset: str | Path | None = None,
    eval_benign_dataset: str | Path | None = None,
    eval_samples: int = 64,
    reply_tokens: int = 16,
    search: int = 0,
    max_kl: float = 0.5,
    batch_size: int = 4,
    refusal_filter: bool = True,
    dispatch: str = "auto",
    dispatch_table: str | Path | None = None,
    dequant_cache: int | str = 0,
    token_budget: int | None = None,
    force: bool = False,
    progress: bool = False,
    log: Log = quiet,
) -> AbliterateResult:
    """Abliterate ``model`` (see the module docstring) and write it to ``output``; evaluation prompts default to
    the capture datasets when no held-out sets are given."""
    from .. import writer
    from ..io import params_nbytes, write_model_dir
    from ..residual import choose_layers

    _check(layers=layers, target=target, safety_map=safety_map, weight=weight, direction=direction,
           direction_layer=direction_layer, rounds=rounds, phrasings=phrasings, extraction_position=extraction_position, search=search,
           max_kl=max_kl, eval_samples=eval_samples, dispatch=dispatch, token_budget=token_budget)
    check_supported(model)
    for name, path in (("harmful_dataset", harmful_dataset), ("benign_dataset", benign_dataset),
                       ("eval_harmful_dataset", eval_harmful_dataset), ("eval_benign_dataset", eval_benign_dataset)):
        if path is not None:
            require_path(name, path, "pass a JSONL file or a directory of text files")
    _check_distinct(harmful_dataset, benign_dataset)
    inputs = {param("model"): model, param("harmful_dataset"): harmful_dataset,
              param("benign_dataset"): benign_dataset}
    with writer.output(output, kind="dir", inputs=inputs, force=force) as res:
        mdl, tok, config, adapter = load_moe(model, log=log)
        settings = dict(dispatch=dispatch, dispatch_table=dispatch_table, dequant_cache=dequant_cache)
        report = apply_dispatch(mdl, **settings, log=log)
        budget = forward_budget(token_budget, config=config, dispatch_mode=report.mode)
        n_layers = len(adapter.decoder_layers())
        choose_layers(layers, [0.0] * n_layers, where=param("layers"))  # the range checks, before any work
        if direction_layer is not None and direction_layer >= n_layers:
            raise UserError(f"{param('direction_layer')} {direction_layer} is outside the model: it has decoder "
                            f"layers 0-{n_layers - 1}.")
        kw = dict(max_tokens=max_tokens, text_key=text_key, seed=seed)
        warnings = []
        job = Abliteration(
            mdl, tok, adapter, harmful=_prompts(harmful_dataset, tok, "harmful_dataset", max_samples=max_samples, **kw),
            benign=_prompts(benign_dataset, tok, "benign_dataset", max_samples=max_samples, **kw),
            eval_h=_prompts(eval_harmful_dataset or harmful_dataset, tok, "eval_harmful_dataset",
                            max_samples=eval_samples, **kw),
            eval_b=_prompts(eval_benign_dataset or benign_dataset, tok, "eval_benign_dataset",
                            max_samples=eval_samples, **kw),
            position=extraction_position, batch_size=batch_size, reply_tokens=reply_tokens, target=target,
            safety=_safety(adapter, target, safety_map), phrasings=phrasings, max_kl=float(max_kl), warnings=warnings,
            refusal_filter=refusal_filter, budget=budget, progress=progress, log=log,
            redispatch=(lambda: _redispatch(mdl, settings)) if report.cached_layers else None)
        if eval_harmful_dataset is None or eval_benign_dataset is None:
            warnings.append("no held-out evaluation sets given: refusals and KL are measured on the capture "
                            f"datasets; pass {param('eval_harmful_dataset')} / {param('eval_benign_dataset')}.")
        first = job.statistics(1)
        norms = first.norms
        single = direction == "single"
        chosen = choose_layers("all" if single and str(layers).strip().lower() == "auto" else layers, norms,
                               where=param("layers"))
        source = (int(norms.argmax()) if direction_layer is None else direction_layer) if single else None
        before = job.measure([], 0.0, original=True)
        trials, after, done = [], None, None
        if search:
            trials, kept = job.search(first, candidates(chosen, norms, float(weight), source, search), rounds,
                                      progress)
            ok = [i for i, t in enumerate(trials) if t.benign_kl <= max_kl]
            if ok:
                i = min(ok, key=lambda i: (trials[i].harmful_refusal, trials[i].benign_kl))
                after, done = trials[i], kept[i]
                chosen, weight, source = after.layers, after.weight, after.direction_layer
            else:
                warnings.append(f"no setting tried stayed under {param('max_kl')} {max_kl}; writing "
                                f"{param('layers')} {layers} at {param('weight')} {weight}.")
        if done is None:
            done, modified, _ = job.abliterate(first, chosen, float(weight), source, rounds)
            if job.over_kl:
                warnings.append(job.over_kl)
        else:
            modified = job.apply(done, chosen, float(weight), source)[0]
        if not modified:
            warnings.append("nothing matched the target in the chosen layers; the model is written unchanged.")
        after = after or job.measure(chosen, float(weight), len(done), source)
        for w in warnings:
            log(f"Warning: {w}")
        meta = {"method": "abliteration", "target": target, "refusal_filter": refusal_filter, "abliterated_layers": chosen, "weight": weight,
                "direction": direction, "direction_layer": source, "extraction_position": extraction_position,
                "layers_spec": str(layers),
                "direction_norms": {str(i): round(float(norms[i]), 6) for i in range(n_layers)},
                "rounds": [r.row() for r in done], "phrasings": phrasings,
                "modified": {str(k): v for k, v in modified.items()},
                "safety_map": None if safety_map is None else str(safety_map),
                "evaluation": {"harmful_prompts": len(job.eval_h), "benign_prompts": len(job.eval_b),
                               "reply_tokens": reply_tokens, "before": before.row(), "after": after.row(),
                               "held_out": eval_harmful_dataset is not None and eval_benign_dataset is not None},
                "search": {"trials": [t.row() for t in trials], "max_kl": max_kl} if trials else None}
        res.require_space(params_nbytes(mdl))
        log(f"Writing {output} ...")
        write_model_dir(res, mdl, config, source=model, metadata={"abliteration_metadata.json": meta})
    return AbliterateResult(Path(output), chosen, float(weight), before, after,
                            {str(i): float(norms[i]) for i in range(n_layers)}, done[0].dirs[0],
                            {str(k): v for k, v in modified.items()}, trials, warnings, direction, source, done)


def _safety(adapter, target: str, safety_map) -> dict[int, list[int]] | None:
    """Decoder layer → the safety report's routed experts, for ``target="safety-experts"``."""
    from ..expert_files import load_report_experts
    from ..rewrite.abliterate import latent_experts

    if target != "safety-experts":
        return None
    if latent_experts(adapter):
        raise UserError(f"model_type '{adapter.model_type}' runs its routed experts in a latent space, so no "
                        f"expert alone writes the residual stream; use {param('target')} all or dense-only.")
    moe = adapter.moe_layers()
    sets = load_report_experts(safety_map, "safety", moe, adapter.num_experts)
    return {moe[p]: sorted(e) for p, e in sets.items() if e}


def _redispatch(model, settings: dict) -> None:
    """Install the dispatch afresh (its dequantized experts from the weights as they are now)."""
    from ..dispatch import remove

    remove(model)
    apply_dispatch(model, **settings)
