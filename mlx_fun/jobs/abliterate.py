"""The ``abliterate`` job: remove the refusal directions from what the decoder layers write, measure what it did.

Capture (:mod:`mlx_fun.observe.residual`) over the harmful prompts the model refuses and the benign ones it answers
(Arditi et al.'s filter, :func:`mlx_fun.observe.refusal.is_refusal`) → per-layer directions → ``direction="single"``: the
one measured after ``direction_layer`` (default: the largest un-normalised difference), removed from every chosen
layer's residual writers and the token embedding; ``"per-layer"``: each layer's own → orthogonalisation
(:mod:`mlx_fun.rewrite.abliterate`). One mean difference describes the commonest way the model refuses, and a
model with several refusal phrasings keeps the others, so a round takes one direction per **phrasing** (the refused
prompts grouped by how their reply opens, :func:`mlx_fun.observe.refusal.phrasing`; up to ``phrasings``, orthonormal), and
each further **round** measures them again on the model abliterated so far, from the prompts it still refuses,
and removes them too; a round that takes the capture benign prompts' first-token KL over ``max_kl`` is undone.
Every round starts from the original weights, so a quantized model is rounded once. Then the refusal rate on the
evaluation harmful prompts and the benign first-token KL against the original (:mod:`mlx_fun.observe.refusal`), and the
model with ``abliteration_metadata.json`` beside it. ``search`` tries settings of (layers, weight, direction
layer), each measured after every round, and keeps the one with the fewest refusals under ``max_kl``.
A model that refuses none of the harmful capture prompts (or all the benign ones) has no refusal to remove: the
job stops there with the measured rates, nothing written, unless ``refusal_filter=False`` (every prompt, whatever
the model replies). Every phase logs what it does and, with ``settings.progress``, shows a bar. The rounds, measuring
and search live in :mod:`mlx_fun.rewrite.abliterate_rounds`, the option groups (``estimate``, ``projection``,
``evaluation``) in :mod:`mlx_fun.rewrite.abliterate_options`; this job checks the inputs, loads the model with the
expert dispatch and the token budget every forward keeps to (``settings``: :class:`mlx_fun.settings.RunSettings`),
and writes. With ``stream_layers`` (chosen by itself for a model larger than the memory left) the model loads lazily
and the same rounds run with one decoder layer's weights in memory at a time
(:mod:`mlx_fun.rewrite.abliterate_streamed`), giving the same directions, measurements and written model; a killed
streamed run resumes, when rerun, after the last phase its checkpoint recorded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import click

from ..core.options import Opt
from ..datasets.calibration import Calibration
from ..errors import UserError, param
from ..model.lora import ADAPTER_PATH
from ..rewrite.abliterate_options import DIRECTIONS, Estimate, Evaluation, Projection, split_benign
from ..rewrite.abliterate_rounds import Abliteration, Prompts, Round, Trial, candidates
from ..settings import RunSettings
from .common import FORCE_DIR, MODEL, Log, check_moe, job, model_job, quiet, stream_choice, stream_layers_opt
from .safety_scan import BENIGN_DATASET, HARMFUL_DATASET

__all__ = ["DIRECTIONS", "AbliterateResult", "Estimate", "Evaluation", "Projection", "run"]


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
    streamed: bool = False  # run one decoder layer at a time (--stream-layers)
    peak_bytes: int = 0  # this process's peak resident memory at the end
    kl_set: str = ""  # where after.held_out_kl (what max_kl bounds) is measured: "32 held-out benign prompts"


#: ``--stream-layers`` of abliterate: its layers are read once per pass over the model, not once
STREAM_LAYERS = stream_layers_opt(
    same="the same directions, refusal and KL measurements and written weights",
    visits="for each pass over the model (one per capture or log-prob pass over a set of prompts, per prefill step "
           "and per reply token of the greedy replies: reading every layer again per token is the price, and one "
           "per round's projection)",
    resumes="after its last finished phase (round 1's statistics, the original model's measurement, each round, "
            "search trial and the final measurement)",
    spills=False)  # its passes carry their prompts' hidden states in memory


def _check_distinct(harmful, benign) -> None:
    """The direction is harmful minus benign: the same prompts on both sides give none."""
    a, b = Path(harmful), Path(benign)
    same = a.resolve() == b.resolve() or (a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes())
    if same:
        raise UserError(f"{param('harmful_dataset')} {harmful} and {param('benign_dataset')} {benign} hold the same "
                        "prompts, so their difference (the refusal direction) is zero; pass prompts the model refuses "
                        "and prompts it answers.")


def _prompts(path, tokenizer, what: str, calibration: Calibration) -> list[list[int]]:
    samples = calibration.load(path, tokenizer, generation_prompt=True)
    if not samples:
        raise UserError(f"{param(what)} {path} holds no prompts; give a JSONL of chats, prompts or text.")
    return samples


def _load_prompts(tokenizer, harmful_dataset, benign_dataset, evaluation: Evaluation,
                  calibration: Calibration) -> Prompts:
    """The capture prompts (``calibration.max_samples`` each; the benign ones drawn with ``kl_holdout`` more, which
    are kept out of the directions for the KL bound, :func:`~mlx_fun.rewrite.abliterate_options.split_benign`) and
    the evaluation prompts (``eval_samples`` each, from the held-out sets or else the capture datasets), every one
    read with its generation prompt."""
    held = dataclasses.replace(calibration, max_samples=evaluation.eval_samples)
    drawn = dataclasses.replace(calibration, max_samples=calibration.max_samples + evaluation.kl_holdout)
    benign, kl_b = split_benign(_prompts(benign_dataset, tokenizer, "benign_dataset", drawn),
                                fit=calibration.max_samples, holdout=evaluation.kl_holdout, seed=calibration.seed)
    return Prompts(
        _prompts(harmful_dataset, tokenizer, "harmful_dataset", calibration), benign,
        _prompts(evaluation.eval_harmful_dataset or harmful_dataset, tokenizer, "eval_harmful_dataset", held),
        _prompts(evaluation.eval_benign_dataset or benign_dataset, tokenizer, "eval_benign_dataset", held), kl_b)


@job
def run(
    *,
    model: Annotated[str | Path, MODEL],
    adapter_path: Annotated[str | Path | None, ADAPTER_PATH] = None,
    harmful_dataset: Annotated[str | Path, HARMFUL_DATASET],
    benign_dataset: Annotated[str | Path, BENIGN_DATASET],
    output: Annotated[str | Path, Opt("Model directory to write.", type=click.Path(file_okay=False))],
    estimate: Estimate = Estimate(),
    projection: Projection = Projection(),
    evaluation: Evaluation = Evaluation(),
    calibration: Calibration = Calibration(batch_size=4),
    settings: RunSettings = RunSettings(),
    force: Annotated[bool, FORCE_DIR] = False,
    stream_layers: Annotated[bool | None, STREAM_LAYERS] = None,
    log: Log = quiet,
) -> AbliterateResult:
    """Abliterate ``model`` (see the module docstring) and write it to ``output``. ``estimate``: how the directions
    are measured (direction, its layer, position, phrasings, rounds, refusal filter); ``projection``: where and how
    strongly they are removed (layers, target, weight, safety map); ``evaluation``: the held-out sets (default: the
    capture datasets), their size, the reply length, the search and its KL limit
    (:mod:`mlx_fun.rewrite.abliterate_options`); ``calibration``: the capture prompts drawn (``max_samples`` per
    dataset; ``max_tokens``, ``text_key`` and ``seed`` for the evaluation prompts too) and ``batch_size`` (its fields
    may be given by name); ``settings``: how the model runs (:class:`mlx_fun.settings.RunSettings`: dispatch, token
    budget, progress bars). Every group checked itself when built, the paths were checked by ``@job``.

    ``stream_layers`` (None: when the model's weights exceed :func:`mlx_fun.runtime.memory.available_bytes`): the
    model loads lazily and every forward runs one decoder layer at a time, each layer read from the model's files
    for each pass and released after it (:mod:`mlx_fun.rewrite.abliterate_streamed`); the written model is read and
    written one tensor at a time. Streamed, the run keeps a checkpoint beside ``output`` (``.<name>.stream/``: each
    phase's results as it ends, the rewritten layers kept while abliterating), so rerunning the same call after a
    kill resumes after the last phase done and writes the same files; it is removed once the output is written. No
    dequantized experts are kept (``settings.dequant_cache``) while streaming.

    ``adapter_path``: a LoRA adapter fused into the model as it loads (:mod:`mlx_fun.model.lora`, ``mlx_lm.fuse``'s
    arithmetic): the fine-tuned model is measured, abliterated and written; its metadata and card name the adapter
    (not with streaming: fuse it first)."""
    from ..model import lora
    from ..output.model_dir import params_nbytes, write_model_dir
    from ..runtime.memory import peak_rss_bytes

    checked = check_moe(model)
    # tokens=0: abliterate's streamed passes carry their prompts' hidden states in memory (no spilling)
    stream = stream_choice(stream_layers, [(model, checked[1], checked[0])], doing="abliterating", log=log,
                           tokens=0, adapter_path=adapter_path).layers
    if stream and settings.dequant_bytes():
        log(f"Note: {param('dequant_cache')} is off while streaming (it would keep dequantized experts of every "
            "layer in memory).")
        settings = dataclasses.replace(settings, dequant_cache="0")
    with model_job(model, output=output, kind="dir", force=force, settings=settings, log=log, checked=checked,
                   before_load=lambda: _check_distinct(harmful_dataset, benign_dataset), lazy=stream,
                   adapter_path=adapter_path, checkpointed=stream) as job_:
        n_layers = _check_layers(job_.adapter, estimate, projection)
        warnings = []
        how = dict(estimate=estimate, projection=projection, evaluation=evaluation, calibration=calibration,
                   settings=settings, warnings=warnings, log=log)
        prompts = _load_prompts(job_.tokenizer, harmful_dataset, benign_dataset, evaluation, calibration)
        abl = (_streamed(job_, model, harmful_dataset, benign_dataset, prompts, how) if stream
               else Abliteration(job_, prompts, **how))
        if not evaluation.held_out:
            warnings.append("no held-out evaluation sets given: refusals and KL are measured on the capture "
                            f"datasets; pass {param('eval_harmful_dataset')} / {param('eval_benign_dataset')}.")
        got = _abliterate(abl, estimate, projection, evaluation, settings.progress, warnings)
        for w in warnings:
            log(f"Warning: {w}")
        meta = {**_metadata(got, abl, estimate, projection, evaluation, n_layers), **lora.recorded(adapter_path)}
        if stream:
            abl.load_for_writing()
        job_.res.require_space(params_nbytes(job_.model))
        log(f"Writing {output} ...")
        write_model_dir(job_.res, job_.model, job_.config, source=model,
                        metadata={"abliteration_metadata.json": meta}, donate=stream)
    norms = got["norms"]
    return AbliterateResult(Path(output), got["layers"], float(got["weight"]), got["before"], got["after"],
                            {str(i): float(norms[i]) for i in range(n_layers)}, got["done"][0].dirs[0],
                            {str(k): v for k, v in got["modified"].items()}, got["trials"], warnings,
                            estimate.direction, got["source"], got["done"], stream, peak_rss_bytes(), abl.kl_set)


def _streamed(job_, model, harmful_dataset, benign_dataset, prompts: Prompts, how: dict):
    """The streamed abliteration (:mod:`mlx_fun.rewrite.abliterate_streamed`) of the lazily loaded ``job_``, resumed
    from its checkpoint beside the output where a killed run of the same command left one (another run's is
    refused, naming what differs): a family whose layers hand state on is refused in one line; the output's
    filesystem must hold the written model and the rewritten layers kept while abliterating."""
    from ..model.layer_files import LayerFiles
    from ..observe.checkpoint import samples_hash
    from ..observe.collect import check_streamable
    from ..output.model_dir import params_nbytes
    from ..rewrite.abliterate_streamed import SCRATCH, StreamedAbliteration, scratch_bytes
    from .common import stream_checkpoint

    check_streamable(job_.adapter, run="a streamed abliterate",
                     instead=f"abliterate it without {param('stream_layers')} on a machine that holds it (abliterate "
                     f"has no {param('pipeline')} across machines, as collect has)")
    checkpoint = stream_checkpoint(
        job_, "abliterate", model=model, dataset=harmful_dataset, samples=prompts.harmful,
        calibration=how["calibration"], benign_dataset=str(Path(benign_dataset).resolve()),
        prompts_sha256={name: samples_hash(getattr(prompts, name)) for name in ("harmful", "benign", "eval_h",
                                                                                "eval_b", "kl_b")},
        **{name: _identity(how[name]) for name in ("estimate", "projection", "evaluation")})
    files = LayerFiles(job_.model, job_.adapter, model, scratch=checkpoint.path / SCRATCH)
    target = how["projection"].target
    job_.res.require_space(params_nbytes(job_.model) + scratch_bytes(job_.adapter, target),
                           what="the output and the rewritten layers kept while abliterating")
    return StreamedAbliteration(job_, prompts, files=files, checkpoint=checkpoint, **how)


def _identity(group) -> dict:
    """An option group as a streamed run's checkpoint names it: its fields, a path it reads resolved (the safety
    map with its hash; the prompts' own hashes are the datasets')."""
    from ..observe.checkpoint import file_hash

    out = dataclasses.asdict(group)
    for name, value in out.items():
        if value is not None and (name.endswith("_dataset") or name == "safety_map"):
            out[name] = str(Path(value).resolve())
            if name == "safety_map":
                out[name] = {"path": out[name], "sha256": file_hash(value)}
    return out


def _check_layers(adapter, estimate: Estimate, projection: Projection) -> int:
    """The layer options against the loaded model (before any work); returns its number of decoder layers."""
    from ..observe.residual import choose_layers

    n_layers = len(adapter.decoder_layers())
    choose_layers(projection.layers, [0.0] * n_layers, where=param("layers"))  # the range checks
    if estimate.direction_layer is not None and estimate.direction_layer >= n_layers:
        raise UserError(f"{param('direction_layer')} {estimate.direction_layer} is outside the model: it has decoder "
                        f"layers 0-{n_layers - 1}.")
    return n_layers


def _abliterate(job: Abliteration, estimate: Estimate, projection: Projection, evaluation: Evaluation,
                progress: bool, warnings: list[str]) -> dict:
    """Round 1's statistics, the original model measured, then the rounds (or the search and the best setting
    under ``max_kl``), the abliterated model measured: what the metadata and the result report, by name."""
    from ..observe.residual import choose_layers

    layers, weight, max_kl = projection.layers, projection.weight, evaluation.max_kl
    first = job.statistics(1)
    norms = first.norms
    single = estimate.direction == "single"
    chosen = choose_layers("all" if single and str(layers).strip().lower() == "auto" else layers, norms,
                           where=param("layers"))
    source = estimate.direction_layer if single else None
    if single and source is None:
        source = int(norms.argmax())
    before = job.measure([], 0.0, original=True)
    trials, after, done = [], None, None
    if evaluation.search:
        trials, kept = job.search(first, candidates(chosen, norms, float(weight), source, evaluation.search),
                                  estimate.rounds, progress)
        ok = [i for i, t in enumerate(trials) if t.held_out_kl <= max_kl]
        if ok:
            i = min(ok, key=lambda i: (trials[i].harmful_refusal, trials[i].held_out_kl))
            after, done = trials[i], kept[i]
            chosen, weight, source = after.layers, after.weight, after.direction_layer
        else:
            warnings.append(f"no setting tried stayed under {param('max_kl')} {max_kl}; writing "
                            f"{param('layers')} {layers} at {param('weight')} {weight}.")
    if done is None:
        done, modified, _ = job.abliterate(first, chosen, float(weight), source, estimate.rounds)
        warnings += [w for w in (job.fallback, job.over_kl) if w]
    else:
        modified = job.apply(done, chosen, float(weight), source)[0]
    if not modified:
        warnings.append("nothing matched the target in the chosen layers; the model is written unchanged.")
    after = after or job.measure(chosen, float(weight), len(done), source)
    if after.held_out_kl > max_kl:
        warnings.append(f"the written model's first-token KL on the {job.kl_set} is {after.held_out_kl:.3f}, over "
                        f"{param('max_kl')} {max_kl:g} (the bound undoes later rounds and extra phrasings only); pass "
                        f"{param('weight')} below {weight:g} or fewer {param('layers')} to stay under it.")
    return dict(norms=norms, layers=chosen, weight=weight, source=source, before=before, after=after, done=done,
                modified=modified, trials=trials)


def _metadata(got: dict, job: Abliteration, estimate: Estimate, projection: Projection, evaluation: Evaluation,
              n_layers: int) -> dict:
    """``abliteration_metadata.json``: the options, what each round took, the measured effect."""
    norms, trials = got["norms"], got["trials"]
    return {"method": "abliteration", "target": projection.target, "refusal_filter": estimate.refusal_filter,
            "abliterated_layers": got["layers"], "weight": got["weight"], "direction": estimate.direction,
            "direction_layer": got["source"], "extraction_position": estimate.extraction_position,
            "layers_spec": str(projection.layers),
            "direction_norms": {str(i): round(float(norms[i]), 6) for i in range(n_layers)},
            "rounds": [r.row() for r in got["done"]], "phrasings": estimate.phrasings,
            "modified": {str(k): v for k, v in got["modified"].items()},
            "safety_map": None if projection.safety_map is None else str(projection.safety_map),
            "evaluation": {"harmful_prompts": len(job.eval_h), "benign_prompts": len(job.eval_b),
                           "reply_tokens": evaluation.reply_tokens, "before": got["before"].row(),
                           "after": got["after"].row(), "held_out": evaluation.held_out,
                           "kl_bound": {"max_kl": evaluation.max_kl, "held_out_kl": round(got["after"].held_out_kl, 4),
                                        "prompts": len(job.kl_b), "held_out": job.kl_b is not job.benign,
                                        "on": f"first-token KL on the {job.kl_set}"}},
            "search": {"trials": [t.row() for t in trials], "max_kl": evaluation.max_kl} if trials else None}
