"""The ``abliterate`` job: remove the refusal direction from what chosen decoder layers write, measure what it did.

Capture (:mod:`mlx_fun.residual`) → per-layer directions → layer choice → orthogonalisation of every residual
writer of the target (:mod:`mlx_fun.rewrite.abliterate`) → refusal rate on the evaluation harmful prompts and
benign first-token KL against the original (:mod:`mlx_fun.refusal`) → the model, ``abliteration_metadata.json``
beside it. ``search`` tries settings of (layers, weight) first and keeps the one with the fewest refusals under
``max_kl``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError, param
from .common import Log, check_supported, load_moe, quiet, require_path


@dataclass
class Trial:
    layers: list[int]
    weight: float
    harmful_refusal: float
    benign_refusal: float
    benign_kl: float

    def row(self) -> dict:
        return {"layers": self.layers, "weight": self.weight, "harmful_refusal": round(self.harmful_refusal, 4),
                "benign_refusal": round(self.benign_refusal, 4), "benign_kl": round(self.benign_kl, 4)}


@dataclass
class AbliterateResult:
    output: Path
    layers: list[int]
    weight: float
    before: Trial  # the original model on the evaluation prompts
    after: Trial
    direction_norms: dict[str, float]
    directions: object  # (decoder layers, hidden) float64 unit directions (numpy)
    modified: dict[str, list[str]]
    trials: list[Trial] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _check(*, layers, target, safety_map, weight, extraction_position, search, max_kl, eval_samples) -> None:
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
    if isinstance(search, bool) or not isinstance(search, int) or search < 0:
        raise UserError(f"{param('search')} must be a whole number >= 0, got {search!r}.")
    if not (isinstance(max_kl, (int, float)) and math.isfinite(max_kl) and max_kl > 0):
        raise UserError(f"{param('max_kl')} must be a positive number, got {max_kl!r}.")
    if isinstance(eval_samples, bool) or not isinstance(eval_samples, int) or eval_samples < 1:
        raise UserError(f"{param('eval_samples')} must be >= 1, got {eval_samples!r}.")
    parse_layers(layers, where=param("layers"))


def _prompts(path, tokenizer, what: str, **kw) -> list[list[int]]:
    from ..data import load_samples

    samples = load_samples(path, tokenizer, generation_prompt=True, **kw)
    if not samples:
        raise UserError(f"{param(what)} {path} holds no prompts; give a JSONL of chats, prompts or text.")
    return samples


def _candidates(chosen: list[int], norms, weight: float, n: int) -> list[tuple[list[int], float]]:
    """Up to ``n`` settings: the chosen layers, then all, the top half / quarter by direction norm and every
    contiguous half-depth window, each at weight 1, 0.8, 0.6, 0.4 (the given weight first)."""
    import numpy as np

    L = len(norms)
    order = [int(i) for i in np.argsort(-np.asarray(norms), kind="stable")]
    windows = [chosen, list(range(L)), sorted(order[: max(1, math.ceil(L / 2))]),
               sorted(order[: max(1, math.ceil(L / 4))])]
    half = max(1, math.ceil(L / 2))
    windows += [list(range(a, a + half)) for a in range(0, L - half + 1)]
    uniq = []
    for w in windows:
        if w not in uniq:
            uniq.append(w)
    weights = [weight] + [w for w in (1.0, 0.8, 0.6, 0.4) if w != weight]
    return [(w, x) for x in weights for w in uniq][:n]


def _search(trial, candidates: list[tuple[list[int], float]], progress: bool) -> list[Trial]:
    """``trial(layers, weight)`` for every candidate, one progress step each (refusals and KL shown)."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(candidates), unit="trial", desc="search", dynamic_ncols=True)
    trials = []
    try:
        for lay, w in candidates:
            trials.append(trial(lay, w))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(refusal=f"{trials[-1].harmful_refusal:.0%}", kl=f"{trials[-1].benign_kl:.3f}")
    finally:
        if bar is not None:
            bar.close()
    return trials


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
    max_samples: int = 64,
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
    force: bool = False,
    progress: bool = False,
    log: Log = quiet,
) -> AbliterateResult:
    """Abliterate ``model`` (see the module docstring) and write it to ``output``; evaluation prompts default to
    the capture datasets when no held-out sets are given."""
    from .. import writer
    from ..data import pad_id
    from ..expert_files import load_report_experts
    from ..io import params_nbytes, write_model_dir
    from ..refusal import first_token_logprobs, greedy_replies, mean_kl, refusal_rate
    from ..residual import capture, choose_layers, directions
    from ..rewrite.abliterate import apply, latent_experts, restore

    _check(layers=layers, target=target, safety_map=safety_map, weight=weight,
           extraction_position=extraction_position, search=search, max_kl=max_kl, eval_samples=eval_samples)
    check_supported(model)
    for name, path in (("harmful_dataset", harmful_dataset), ("benign_dataset", benign_dataset),
                       ("eval_harmful_dataset", eval_harmful_dataset), ("eval_benign_dataset", eval_benign_dataset)):
        if path is not None:
            require_path(name, path, "pass a JSONL file or a directory of text files")
    inputs = {param("model"): model, param("harmful_dataset"): harmful_dataset,
              param("benign_dataset"): benign_dataset}
    with writer.output(output, kind="dir", inputs=inputs, force=force) as res:
        mdl, tok, config, adapter = load_moe(model, log=log)
        n_layers = len(adapter.decoder_layers())
        choose_layers(layers, [0.0] * n_layers, where=param("layers"))  # the range check, before any work
        safety = None
        if target == "safety-experts":
            if latent_experts(adapter):
                raise UserError(f"model_type '{adapter.model_type}' runs its routed experts in a latent space, so no "
                                f"expert alone writes the residual stream; use {param('target')} all or dense-only.")
            moe = adapter.moe_layers()
            sets = load_report_experts(safety_map, "safety", moe, adapter.num_experts)
            safety = {moe[p]: sorted(e) for p, e in sets.items() if e}
        kw = dict(max_samples=max_samples, max_tokens=max_tokens, text_key=text_key, seed=seed)
        harmful = _prompts(harmful_dataset, tok, "harmful_dataset", **kw)
        benign = _prompts(benign_dataset, tok, "benign_dataset", **kw)
        pad = pad_id(tok)
        means = [capture(mdl, adapter, s, position=extraction_position, batch_size=batch_size, pad_id=pad,
                         progress=progress, desc=name) for s, name in ((harmful, "harmful"), (benign, "benign"))]
        dirs, norms = directions(*means)
        chosen = choose_layers(layers, norms, where=param("layers"))
        ekw = dict(max_samples=eval_samples, max_tokens=max_tokens, text_key=text_key, seed=seed)
        eval_h = _prompts(eval_harmful_dataset or harmful_dataset, tok, "eval_harmful_dataset", **ekw)
        eval_b = _prompts(eval_benign_dataset or benign_dataset, tok, "eval_benign_dataset", **ekw)
        warnings = []
        if eval_harmful_dataset is None or eval_benign_dataset is None:
            warnings.append("no held-out evaluation sets given: refusals and KL are measured on the capture "
                            f"datasets; pass {param('eval_harmful_dataset')} / {param('eval_benign_dataset')}.")
        reference = first_token_logprobs(mdl, eval_b)

        def measure(lay, w, original: bool = False) -> Trial:
            kl = 0.0 if original else mean_kl(reference, first_token_logprobs(mdl, eval_b))
            return Trial(lay, w, refusal_rate(greedy_replies(mdl, tok, eval_h, reply_tokens)),
                         refusal_rate(greedy_replies(mdl, tok, eval_b, reply_tokens)), kl)

        def trial(lay, w) -> Trial:
            _, undo = apply(adapter, dirs, lay, target=target, weight=w, safety=safety)
            try:
                return measure(lay, w)
            finally:
                restore(undo)

        before = measure([], 0.0, original=True)
        trials = _search(trial, _candidates(chosen, norms, float(weight), search), progress) if search else []
        if trials:
            ok = [t for t in trials if t.benign_kl <= max_kl]
            if ok:
                best = min(ok, key=lambda t: (t.harmful_refusal, t.benign_kl))
                chosen, weight = best.layers, best.weight
            else:
                warnings.append(f"no setting tried stayed under {param('max_kl')} {max_kl}; writing "
                                f"{param('layers')} {layers} at {param('weight')} {weight}.")
        modified, _undo = apply(adapter, dirs, chosen, target=target, weight=float(weight), safety=safety)
        if not modified:
            warnings.append("nothing matched the target in the chosen layers; the model is written unchanged.")
        after = next((t for t in trials if t.layers == chosen and t.weight == weight), None) or measure(chosen, weight)
        for w in warnings:
            log(f"Warning: {w}")
        meta = {"method": "abliteration", "target": target, "abliterated_layers": chosen, "weight": weight,
                "extraction_position": extraction_position, "layers_spec": str(layers),
                "direction_norms": {str(i): round(float(norms[i]), 6) for i in range(n_layers)},
                "modified": {str(k): v for k, v in modified.items()},
                "safety_map": None if safety_map is None else str(safety_map),
                "evaluation": {"harmful_prompts": len(eval_h), "benign_prompts": len(eval_b),
                               "reply_tokens": reply_tokens, "before": before.row(), "after": after.row(),
                               "held_out": eval_harmful_dataset is not None and eval_benign_dataset is not None},
                "search": {"trials": [t.row() for t in trials], "max_kl": max_kl} if trials else None}
        res.require_space(params_nbytes(mdl))
        write_model_dir(res, mdl, config, source=model, metadata={"abliteration_metadata.json": meta})
    return AbliterateResult(Path(output), chosen, float(weight), before, after,
                            {str(i): float(norms[i]) for i in range(n_layers)}, dirs,
                            {str(k): v for k, v in modified.items()}, trials, warnings)
