"""The ``eval`` job: perplexity per dataset and, against a reference, next-token KL and top-1 agreement."""

from __future__ import annotations

import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Sequence

import click

from .. import __version__
from ..adapters import REGISTRY
from ..core.options import Opt
from ..datasets.calibration import Calibration
from ..errors import UserError, param
from ..model.lora import ADAPTER_PATH
from ..settings import RunSettings
from .common import (FORCE, MODEL, Loaded, Log, StreamPlan, job, model_job, quiet, stream_choice, stream_layers_opt,
                     warn_past_context)


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


@job(any_model=True)
def run(
    *,
    model: Annotated[str | Path, MODEL],
    adapter_path: Annotated[str | Path | None, ADAPTER_PATH] = None,
    reference: Annotated[str | Path | None, Opt(
        "Reference model (e.g. the original before pruning): a local directory or a Hugging Face repo id, as --model "
        "(a local directory of that name wins; the repo at its default branch, since --revision is --model's); adds "
        "ref ppl, KL and top-1 agreement.")] = None,
    dataset: Annotated[Sequence[str | Path], Opt(
        "JSONL file or directory of text files (repeat for several; NAME=PATH names one). Reported under the file "
        "stem or directory name.", type=click.STRING, multiple=True)],
    calibration: Calibration = Calibration(seed=0, batch_size=4),
    output: Annotated[str | Path | None, Opt("Also write the results as JSON to this file.")] = None,
    force: Annotated[bool, FORCE] = False,
    settings: RunSettings = RunSettings(),
    stream_layers: Annotated[bool | None, stream_layers_opt(
        same="same numbers: token counts exactly, ppl, KL and top-1 agreement to float rounding; with --reference both "
        "models, layer by layer side by side; supported Mixture-of-Experts families only")] = None,
    log: Log = quiet,
) -> EvalResult:
    """Score ``model`` on each ``dataset`` (paths, or ``NAME=PATH``); with ``reference``, also the reference's
    perplexity on the same tokens, mean KL(reference ‖ model) and top-1 agreement. ``output`` (JSON) is reserved
    before loading and written atomically (an existing file only with ``force``). Float and quantized models of any
    family mlx-lm loads. ``calibration``: which samples are scored (``max_tokens`` at least 2: one token is
    predicted from another; the seed is fixed, 0, so repeated runs score the same samples) and how many a forward
    takes (its fields may be given by name).

    ``stream_layers`` (None: when the weights of the model and the reference together exceed
    :func:`mlx_fun.runtime.memory.available_bytes`): each model runs one decoder layer at a time, each layer released
    after its visit (:func:`mlx_fun.observe.evaluate_streamed.evaluate_streamed`); refused for a model without an
    adapter (dense), which the automatic choice evaluates in memory. ``adapter_path``: a LoRA adapter fused into
    ``model`` (not the reference) as it loads (:mod:`mlx_fun.model.lora`), recorded in ``output``."""
    from ..core import writer
    from ..model import lora
    from ..model.io import load_model
    from ..observe.evaluate import check_compatible, resolve_datasets

    if calibration.max_tokens < 2:
        raise UserError(f"{param('max_tokens')} must be a whole number >= 2, got {calibration.max_tokens!r}.")
    model_config = check_model_dir(model, "model")
    ref_config = check_model_dir(reference, "reference") if reference is not None else None
    paths = resolve_datasets(dataset)
    if ref_config is not None:
        check_compatible(None, None, model_config, ref_config)
    plan = stream_choice(stream_layers, [(model, REGISTRY.get(model_config["model_type"]), model_config)] + (
        [] if ref_config is None else [(reference, REGISTRY.get(ref_config["model_type"]), ref_config)]),
        doing="evaluating", log=log, tokens=len(paths) * calibration.max_samples * calibration.max_tokens)
    if output:  # a NAME=PATH dataset is checked by its path (job_inputs names the values as given)
        writer.check_output_path(output, kind="file", inputs={param("dataset"): [str(p) for p in paths.values()]},
                                 force=force)

    def load():
        log(f"Loading {model}" + ("" if adapter_path is None else f" with the adapter {adapter_path} fused") + " ...")
        loaded = load_model(model, lazy=True, flag=param("model"), adapter_path=adapter_path)
        if (line := lora.note(loaded[0])) is not None:
            log(f"Note: {line}")
        return (*loaded, None)

    with model_job(model, output=output or None, kind="file", force=force, log=log, checked=(model_config, None),
                   load=load, adapter_path=adapter_path, checkpointed=plan.layers) as job_:
        ref = None
        report = settings.apply(job_.model, log=log)
        if reference is not None:
            log(f"Loading reference {reference} ...")
            ref, ref_tokenizer, _ = load_model(reference, lazy=True, flag=param("reference"))
            settings.apply(ref, log=log)
            check_compatible(job_.tokenizer, ref_tokenizer, model_config, ref_config)
        result = _score(job_, ref, paths, calibration, settings, report.mode, model=model, reference=reference,
                        ref_config=ref_config, output=output, log=log, plan=plan, adapter_path=adapter_path)
    return result


def _score(job_: Loaded, ref, paths: dict, calibration: Calibration, settings: RunSettings, mode: str, *, model,
           reference, ref_config: dict | None, output, log: Log, plan: StreamPlan = StreamPlan(False),
           adapter_path=None) -> EvalResult:
    """The scoring pass of :func:`run` on the loaded model (and reference); writes ``job_.res`` when reserved."""
    from ..datasets.samples import pad_id as batch_pad_id
    from ..model import hub, lora
    from ..observe.evaluate import evaluate, load_eval_datasets

    model_config, c = job_.config, calibration
    data = load_eval_datasets(paths, job_.tokenizer, max_samples=c.max_samples, max_tokens=c.max_tokens,
                              seed=c.seed, text_key=c.text_key)
    log(f"{model_config['model_type']}: " + ", ".join(f"{name}: {len(s)} samples" for name, s in data.items()))
    warnings = warn_past_context([x for samples in data.values() for x in samples], model_config, log)
    pad_id = batch_pad_id(job_.tokenizer)
    budget = settings.budget(model_config, dispatch_mode=mode)
    start = time.perf_counter()
    if plan.layers:
        from ..adapters import get_adapter
        from ..observe.evaluate_streamed import evaluate_streamed

        results = evaluate_streamed(job_.model, get_adapter(job_.model, model_config), data, ref,
                                    None if ref is None else get_adapter(ref, ref_config), batch_size=c.batch_size,
                                    pad_id=pad_id, token_budget=budget, progress=settings.progress,
                                    spill=plan.spill_dir(job_.res), log=log,
                                    checkpoint=_checkpoint(job_, model, reference, paths, data, calibration,
                                                           dispatch=mode, token_budget=budget,
                                                           adapter_path=adapter_path))
    else:
        results = evaluate(job_.model, data, reference=ref, batch_size=c.batch_size, pad_id=pad_id,
                           token_budget=budget, progress=settings.progress)
    seconds = time.perf_counter() - start
    out = {
        "model": hub.display_name(model),  # a repo id as the user gave it, not its snapshot directory in the cache
        **lora.recorded(adapter_path),
        "reference": hub.display_name(reference),
        "model_source": hub.source(model),  # {repo_id, revision, commit} of a repo id; None for a local directory
        "reference_source": hub.source(reference),
        "model_type": model_config.get("model_type"),
        "quantization": model_config.get("quantization"),
        "reference_quantization": None if ref_config is None else ref_config.get("quantization"),
        "settings": {"max_samples": c.max_samples, "max_tokens": c.max_tokens, "seed": c.seed,
                     "text_key": c.text_key, "batch_size": c.batch_size, "dispatch": mode, "pad_id": pad_id,
                     "token_budget": budget},
        "datasets": {name: {"path": str(paths[name]), **r} for name, r in results.items()},
        "elapsed_s": round(seconds, 3),
        "versions": versions(),
    }
    if job_.res is not None:
        job_.res.write_json(json_safe(out))
    return EvalResult(results, out, seconds, Path(output) if output else None, warnings)


def _checkpoint(job_: Loaded, model, reference, paths: dict, data: dict, calibration: Calibration, **how):
    """A streamed eval's checkpoint beside its ``--output`` (None without one): named by the model, the
    reference, every dataset and their samples, and ``how`` it runs (dispatch, token budget)."""
    if job_.res is None:
        return None
    from ..observe.checkpoint import file_hash
    from .common import stream_checkpoint

    first = next(iter(paths.values()))
    ref = {} if reference is None else {"reference": str(Path(reference).resolve()),
                                        "reference_config_sha256": file_hash(Path(reference) / "config.json")}
    return stream_checkpoint(job_, "eval", model=model, dataset=first, calibration=calibration,
                             samples=[s for samples in data.values() for s in samples],
                             datasets={name: str(Path(p).resolve()) for name, p in paths.items()}, **ref, **how)


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
