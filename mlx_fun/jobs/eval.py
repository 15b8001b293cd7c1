"""The ``eval`` job: perplexity per dataset and, against a reference, next-token KL and top-1 agreement."""

from __future__ import annotations

import contextlib
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from .. import __version__
from ..errors import UserError, param
from ..settings import RunSettings
from .common import Log, quiet, warn_past_context


@dataclass
class EvalResult:
    results: dict  # dataset name → {samples, tokens, nll, ppl[, ref_nll, ref_ppl, kl, top1_agreement]}
    report: dict  # what ``output`` holds: results, settings, versions
    seconds: float
    output: Path | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(r["tokens"] for r in self.results.values())


def check_model_dir(path, name: str) -> dict:
    """Fail fast (before loading weights) on a missing directory or config; return the config."""
    from ..model.io import read_config

    if not Path(path).exists():
        raise UserError(f"{param(name)} {path} does not exist; pass a local mlx-lm model directory or a Hugging Face repo id (org/name).")
    config = read_config(path)
    if not isinstance(config, dict) or "model_type" not in config:
        raise UserError(f"{path}/config.json has no model_type; {param(name)} must be an mlx-lm model directory.")
    return config


def run(
    *,
    model: str | Path,
    dataset: Sequence[str | Path],
    reference: str | Path | None = None,
    max_samples: int = 128,
    max_tokens: int = 2048,
    text_key: str = "content",
    seed: int = 0,
    batch_size: int = 4,
    output: str | Path | None = None,
    force: bool = False,
    settings: RunSettings = RunSettings(),
    log: Log = quiet,
) -> EvalResult:
    """Score ``model`` on each ``dataset`` (paths, or ``NAME=PATH``); with ``reference``, also the reference's
    perplexity on the same tokens, mean KL(reference ‖ model) and top-1 agreement. ``output`` (JSON) is reserved
    before loading and written atomically (an existing file only with ``force``). Float and quantized models of any family mlx-lm loads."""
    from ..core import writer
    from ..datasets.samples import pad_id as batch_pad_id
    from ..observe.evaluate import check_compatible, evaluate, load_eval_datasets, resolve_datasets
    from ..model.io import load_model

    model_config = check_model_dir(model, "model")
    ref_config = check_model_dir(reference, "reference") if reference is not None else None
    paths = resolve_datasets(dataset)
    settings.check()
    if ref_config is not None:
        check_compatible(None, None, model_config, ref_config)
    inputs = {param("model"): model, param("reference"): reference, param("dataset"): [str(p) for p in paths.values()]}
    with writer.output(output, kind="file", inputs=inputs, force=force) if output else contextlib.nullcontext() as res:
        log(f"Loading {model} ...")
        mdl, tokenizer, _ = load_model(model, lazy=True, flag=param("model"))
        report = settings.apply(mdl, log=log)
        ref = None
        if reference is not None:
            log(f"Loading reference {reference} ...")
            ref, ref_tokenizer, _ = load_model(reference, lazy=True, flag=param("reference"))
            settings.apply(ref, log=log)
            check_compatible(tokenizer, ref_tokenizer, model_config, ref_config)
        data = load_eval_datasets(paths, tokenizer, max_samples=max_samples, max_tokens=max_tokens, seed=seed,
                                  text_key=text_key)
        log(f"{model_config['model_type']}: " + ", ".join(f"{name}: {len(s)} samples" for name, s in data.items()))
        warnings = warn_past_context([x for samples in data.values() for x in samples], model_config, log)
        pad_id = batch_pad_id(tokenizer)
        budget = settings.budget(model_config, dispatch_mode=report.mode)
        start = time.perf_counter()
        results = evaluate(mdl, data, reference=ref, batch_size=batch_size, pad_id=pad_id,
                           token_budget=budget, progress=settings.progress)
        seconds = time.perf_counter() - start
        out = {
            "model": str(model),
            "reference": None if reference is None else str(reference),
            "model_type": model_config.get("model_type"),
            "quantization": model_config.get("quantization"),
            "reference_quantization": None if ref_config is None else ref_config.get("quantization"),
            "settings": {"max_samples": max_samples, "max_tokens": max_tokens, "seed": seed, "text_key": text_key,
                         "batch_size": batch_size, "dispatch": report.mode, "pad_id": pad_id,
                         "token_budget": budget},
            "datasets": {name: {"path": str(paths[name]), **r} for name, r in results.items()},
            "elapsed_s": round(seconds, 3),
            "versions": versions(),
        }
        if res is not None:
            res.write_json(json_safe(out))
    return EvalResult(results, out, seconds, Path(output) if output else None, warnings)


def json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def versions() -> dict:
    from importlib import metadata

    import mlx.core as mx

    def version(dist: str):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {
        "mlx_fun": __version__,
        "mlx": version("mlx") or getattr(mx, "__version__", None),
        "mlx_lm": version("mlx-lm"),
        "python": platform.python_version(),
        "device": str(mx.default_device()),
    }
