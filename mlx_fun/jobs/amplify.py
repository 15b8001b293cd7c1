"""The ``amplify`` job: favour a domain's experts permanently, in a model plain ``mlx_lm.load`` opens."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UserError, param
from .common import Log, check_supported, load_moe, quiet, require_path


@dataclass
class AmplifyResult:
    output: Path
    target: str  # "selection" (a selection-only bias) or "logit" (the router's bias)
    boosted: dict[str, dict[str, float]]  # decoder layer → expert → boost
    warnings: list[str] = field(default_factory=list)


def run(
    *,
    model: str | Path,
    domain_map: str | Path,
    output: str | Path,
    scale: float = 1.0,
    threshold: float = 0.0,
    force: bool = False,
    log: Log = quiet,
) -> AmplifyResult:
    """Add ``scale × max(0, composite − threshold)`` to each domain expert's router bias (the family's own
    selection-only bias, else the router's linear bias) and write the model to ``output``
    (:mod:`mlx_fun.rewrite.amplify`); families without such a parameter are refused."""
    import json

    from .. import writer
    from ..expert_files import load_report_experts
    from ..io import params_nbytes, write_model_dir
    from ..rewrite.amplify import apply, boosts, target
    from ..streaming import Snapshot

    for name, value in (("scale", scale), ("threshold", threshold)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"{param(name)} must be a finite number, got {value!r}.")
    if scale < 0:
        raise UserError(f"{param('scale')} must be >= 0 (0 writes the model unchanged), got {scale}.")
    check_supported(model)
    require_path("domain_map", domain_map, "pass a domain_report.json written by `mlx-fun domain-scan`")
    inputs = {param("model"): model, param("domain_map"): domain_map}
    with writer.output(output, kind="dir", inputs=inputs, force=force) as res:
        mdl, _tok, config, adapter = load_moe(model, lazy=True, log=log)
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
            report = json.loads(Path(domain_map).read_text())
            composite = np.asarray(report["scores"]["composite"], dtype=np.float64)
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{param('domain_map')} {domain_map} has no scores.composite; write it with "
                            "`mlx-fun domain-scan`.") from None
        if composite.shape != (len(layers), adapter.num_experts):
            raise UserError(f"{param('domain_map')} {domain_map}: scores.composite has shape {composite.shape}, "
                            f"the model {(len(layers), adapter.num_experts)}; scan this model.")
        boost = boosts(composite, domain, scale=float(scale), threshold=float(threshold))
        paths = apply(adapter, boost)
        boosted = {str(layers[p]): {str(e): round(float(boost[p, e]), 6) for e in np.flatnonzero(boost[p])}
                   for p in range(len(layers)) if boost[p].any()}
        warnings = [] if boosted else [f"no domain expert has a composite score above {param('threshold')} "
                                       f"{threshold}; the model is written unchanged."]
        for w in warnings:
            log(f"Warning: {w}")
        meta = {"domain_name": report.get("domain_name"), "domain_map": str(domain_map), "scale": scale,
                "threshold": threshold, "target": found[1], "parameters": paths, "boost": boosted,
                "bias_per_layer": {str(layers[p]): boost[p].round(6).tolist() for p in range(len(layers))}}
        res.require_space(params_nbytes(mdl))
        write_model_dir(res, mdl, config, source=model, metadata={"amplification_metadata.json": meta},
                        snapshot=snapshot, donate=True)
    return AmplifyResult(Path(output), found[1], boosted, warnings)
