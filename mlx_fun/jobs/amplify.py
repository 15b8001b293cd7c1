"""The ``amplify`` job: favour a domain's experts permanently, in a model plain ``mlx_lm.load`` opens."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import click
import numpy as np

from ..core.options import Opt
from ..core.ranges import FiniteFloat
from ..errors import UserError, param
from .common import FORCE_DIR, MODEL, Log, job, model_job, quiet


@dataclass
class AmplifyResult:
    output: Path
    target: str  # "selection" (a selection-only bias) or "logit" (the router's bias)
    boosted: dict[str, dict[str, float]]  # decoder layer → expert → boost
    warnings: list[str] = field(default_factory=list)


@job
def run(
    *,
    model: Annotated[str | Path, MODEL],
    domain_map: Annotated[str | Path, Opt("domain_report.json from `mlx-fun domain-scan` (its domain experts and "
                                          "composite scores).", type=click.Path(dir_okay=False),
                                          missing="pass a domain_report.json written by `mlx-fun domain-scan`")],
    output: Annotated[str | Path, Opt("Model directory to write.", type=click.Path(file_okay=False))],
    scale: Annotated[float, Opt("Boost = scale × max(0, composite − threshold) per domain expert.",
                                type=FiniteFloat(min=0.0, min_open=True))] = 1.0,
    threshold: Annotated[float, Opt("Composite score a domain expert must exceed to be boosted.",
                                    type=FiniteFloat())] = 0.0,
    force: Annotated[bool, FORCE_DIR] = False,
    log: Log = quiet,
) -> AmplifyResult:
    """Add ``scale × max(0, composite − threshold)`` to each domain expert's router bias (the family's own
    selection-only bias, else the router's linear bias) and write the model to ``output``
    (:mod:`mlx_fun.rewrite.amplify`); families without such a parameter are refused."""
    from ..core import json_input
    from ..experts.expert_files import load_report_experts
    from ..output.model_dir import params_nbytes, write_model_dir
    from ..rewrite.amplify import apply, target
    from ..output.streaming import Snapshot

    with model_job(model, output=output, kind="dir", force=force, log=log, lazy=True, tokenizer=False) as job_:
        res, mdl, config, adapter = job_.res, job_.model, job_.config, job_.adapter
        snapshot = Snapshot(mdl, model, config)  # streaming: untouched tensors are copied from the files
        found = target(adapter, adapter.blocks()[0])
        if found is None:
            raise UserError(
                f"model_type '{adapter.model_type}' has no router bias that its mlx-lm class loads (adding one would "
                f"make a model mlx_lm.load refuses); boost its domain experts at run time with `mlx-fun steer "
                f"--domain-map {domain_map} --domain-mode boost` or `mlx-fun serve --domain-map {domain_map} "
                f"--domain-steering-mode boost`.")
        layers = adapter.moe_layers()
        domain = load_report_experts(domain_map, "domain", layers, adapter.num_experts)
        try:
            report = json_input.read(domain_map, allow_nan=True, error=ValueError)
            composite = np.asarray(report["scores"]["composite"], dtype=np.float64)
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{param('domain_map')} {domain_map} has no scores.composite; write it with "
                            "`mlx-fun domain-scan`.") from None
        if not np.isfinite(composite).all():
            raise UserError(f"{param('domain_map')} {domain_map}: scores.composite holds non-finite values "
                            f"(NaN / Infinity); write it again with `mlx-fun domain-scan`.")
        if composite.shape != (len(layers), adapter.num_experts):
            raise UserError(f"{param('domain_map')} {domain_map}: scores.composite has shape {composite.shape}, "
                            f"the model {(len(layers), adapter.num_experts)}; scan this model.")
        boost = _checked_boost(adapter, composite, domain, scale=float(scale), threshold=float(threshold),
                               name=found[0], domain_map=domain_map)
        paths = apply(adapter, boost)
        boosted = {str(layers[p]): {str(e): round(float(boost[p, e]), 6) for e in np.flatnonzero(boost[p])}
                   for p in range(len(layers)) if boost[p].any()}
        meta = {"domain_name": report.get("domain_name"), "domain_map": str(domain_map), "scale": scale,
                "threshold": threshold, "target": found[1], "parameters": paths, "boost": boosted,
                "bias_per_layer": {str(layers[p]): boost[p].round(6).tolist() for p in range(len(layers))}}
        res.require_space(params_nbytes(mdl))
        write_model_dir(res, mdl, config, source=model, metadata={"amplification_metadata.json": meta},
                        snapshot=snapshot, donate=True)
    return AmplifyResult(Path(output), found[1], boosted)


def _checked_boost(adapter, composite, domain, *, scale: float, threshold: float, name: str, domain_map) -> np.ndarray:
    """The boost, once sure that every biased value stays finite in the bias's dtype; else a one-line refusal
    naming ``scale`` and the largest finite scale for this model, domain map and threshold."""
    from ..rewrite.amplify import boosts, changes, largest_scale

    unit = boosts(composite, domain, scale=1.0, threshold=threshold)
    if not np.isfinite(unit).all():
        raise UserError(f"{param('threshold')} {threshold:g} is so far below the composite scores that "
                        f"composite − threshold overflows; pass a {param('threshold')} near the scores "
                        f"(those in {domain_map} lie in [{composite.min():.3g}, {composite.max():.3g}]).")
    scores = [float(composite[p, e]) for p, experts in domain.items() for e in experts]
    span = f"those of its domain experts lie in [{min(scores):.3g}, {max(scores):.3g}]" if scores else "it lists none"
    if not unit.any():
        raise UserError(f"no domain expert of {param('domain_map')} {domain_map} has a composite score above "
                        f"{param('threshold')} {threshold:g} ({span}), so nothing would be boosted; pass a "
                        f"lower {param('threshold')}.")
    limit, dtype = largest_scale(adapter, unit)
    if scale > limit and limit < 1 and threshold < min(scores):
        raise UserError(f"{param('threshold')} {threshold:g} is so far below the composite scores ({span}) that "
                        f"composite − threshold passes {dtype}'s largest value already at {param('scale')} 1; "
                        f"pass a {param('threshold')} near the scores.")
    if scale > limit:
        where = f"this model, {param('domain_map')} {domain_map} and {param('threshold')} {threshold:g}"
        fix = (f"the largest finite scale for {where} is {_round_down(limit):g}; pass {param('scale')} "
               f"{_round_down(limit):g} or less" if limit > 0 else f"no scale above 0 keeps it finite for {where}")
        raise UserError(f"{param('scale')} {scale:g} would make {name} infinite in {dtype} (the boost reaches "
                        f"{float(unit.max()) * scale:.3g}); {fix}.")
    boost = boosts(composite, domain, scale=scale, threshold=threshold)
    if not changes(adapter, boost):
        raise UserError(f"{param('scale')} {scale:g} changes no {name} in {dtype}: the largest boost, "
                        f"{float(boost.max()):.3g}, rounds away next to the bias; pass a larger {param('scale')}.")
    return boost


def _round_down(x: float) -> float:
    """``x`` cut (never rounded up) to 3 significant digits, so the number a message offers is safe to pass."""
    from decimal import ROUND_DOWN, Context, Decimal

    return float(Context(prec=3, rounding=ROUND_DOWN).create_decimal(Decimal(x)))
