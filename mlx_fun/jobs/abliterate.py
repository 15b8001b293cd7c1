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
the model replies). Every phase logs what it does and, with ``progress``, shows a bar.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError, param
from .common import Log, apply_dispatch, check_supported, forward_budget, load_moe, quiet, require_path


DIRECTIONS = ("single", "per-layer")
MIN_REFUSED = 2  # a later round needs at least this many harmful prompts the model still refuses
MIN_PHRASING = 4  # refused prompts a phrasing needs for a direction of its own


@dataclass
class Trial:
    layers: list[int]
    weight: float
    harmful_refusal: float
    benign_refusal: float
    benign_kl: float
    rounds: int = 0
    direction_layer: int | None = None  # the single direction's source layer (None: one per layer)

    def row(self) -> dict:
        return {"layers": self.layers, "weight": self.weight, "direction_layer": self.direction_layer,
                "rounds": self.rounds, "harmful_refusal": round(self.harmful_refusal, 4),
                "benign_refusal": round(self.benign_refusal, 4), "benign_kl": round(self.benign_kl, 4)}


@dataclass
class Round:
    """One estimation round: the capture prompts it used (harmful ones the model still refused, benign ones it
    answered, out of all), the refusal phrasings it took a direction from and the directions it removed."""
    refused: int
    harmful: int
    answered: int
    benign: int
    norm: float  # un-normalised mean difference at the source layer (per-layer: the largest)
    dirs: object  # (k, decoder layers, hidden) unit directions removed in this round, orthogonal to earlier rounds'
    phrasings: dict[str, int] = field(default_factory=dict)  # phrasing → refused prompts, one per direction

    def row(self) -> dict:
        return {"refused_harmful": self.refused, "harmful_prompts": self.harmful, "answered_benign": self.answered,
                "benign_prompts": self.benign, "direction_norm": round(self.norm, 6), "phrasings": self.phrasings}


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
    for name, value, low in (("search", search, 0), ("rounds", rounds, 1), ("phrasings", phrasings, 1), ("eval_samples", eval_samples, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise UserError(f"{param(name)} must be a whole number >= {low}, got {value!r}.")
    if not (isinstance(max_kl, (int, float)) and math.isfinite(max_kl) and max_kl > 0):
        raise UserError(f"{param('max_kl')} must be a positive number, got {max_kl!r}.")
    parse_layers(layers, where=param("layers"))
    if dispatch not in ("auto", "mlx-lm"):
        raise UserError(f"{param('dispatch')} must be auto or mlx-lm, got {dispatch!r}.")
    if token_budget is not None and (isinstance(token_budget, bool) or not isinstance(token_budget, int)
                                     or token_budget < 1):
        raise UserError(f"{param('token_budget')} must be a whole number >= 1, got {token_budget!r}.")


def _check_distinct(harmful, benign) -> None:
    """The direction is harmful minus benign: the same prompts on both sides give none."""
    a, b = Path(harmful), Path(benign)
    same = a.resolve() == b.resolve() or (a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes())
    if same:
        raise UserError(f"{param('harmful_dataset')} {harmful} and {param('benign_dataset')} {benign} hold the same "
                        "prompts, so their difference (the refusal direction) is zero; pass prompts the model refuses "
                        "and prompts it answers.")


def _check_refusals(refused: int, harmful: int, answered: int, benign: int, reply_tokens: int) -> None:
    """Arditi et al.'s filter keeps the harmful prompts the model refuses and the benign ones it answers: with none
    on one side there is no refusal to measure (a model that does not refuse has nothing to abliterate)."""
    off = "--no-refusal-filter" if param("x").startswith("--") else "refusal_filter=False"
    if not refused:
        raise UserError(f"the model refuses none of the {harmful} harmful capture prompts (0.0% of its first "
                        f"{reply_tokens}-token replies open like a refusal), so there is no refusal to remove and "
                        f"nothing was written; pass prompts this model refuses to {param('harmful_dataset')} (try one "
                        f"with `mlx-fun smoke-test`), or {off} to take the direction from every prompt anyway.")
    if not answered:
        raise UserError(f"the model refuses all {benign} benign capture prompts (100.0%; harmful: {refused} of "
                        f"{harmful}, {refused / harmful:.1%}), so there is nothing to compare its refusals with and "
                        f"nothing was written; pass prompts it answers to {param('benign_dataset')}, or {off}.")


def _prompts(path, tokenizer, what: str, **kw) -> list[list[int]]:
    from ..data import load_samples

    samples = load_samples(path, tokenizer, generation_prompt=True, **kw)
    if not samples:
        raise UserError(f"{param(what)} {path} holds no prompts; give a JSONL of chats, prompts or text.")
    return samples


def _candidates(chosen: list[int], norms, weight: float, source: int | None, n: int
                ) -> list[tuple[list[int], float, int | None]]:
    """Up to ``n`` settings (layers, weight, source layer): the chosen ones first; then, at weight 1, 0.8, 0.6, 0.4
    (the given weight first), every source layer by direction norm (single direction) and the layer windows —
    all, the top half / quarter by norm and, one direction per layer, every contiguous half-depth window."""
    import numpy as np

    L = len(norms)
    order = [int(i) for i in np.argsort(-np.asarray(norms), kind="stable")]
    windows = [chosen, list(range(L)), sorted(order[: max(1, math.ceil(L / 2))])]
    if source is None:
        half = max(1, math.ceil(L / 2))
        windows += [sorted(order[: max(1, math.ceil(L / 4))])] + [list(range(a, a + half)) for a in range(L - half + 1)]
    sources = [None] if source is None else [source] + [i for i in order if i != source]
    weights = [weight] + [w for w in (1.0, 0.8, 0.6, 0.4) if w != weight]
    out = []
    for x in weights:
        for src in sources:
            for w in windows:
                if (w, x, src) not in out:
                    out.append((w, x, src))
    return out[:n]


@dataclass
class _Stats:
    """What one round measured on the model as it was: the prompts it used, the raw per-layer directions of all
    refused prompts, and each phrasing's un-normalised mean difference."""
    refused: int
    harmful: int
    answered: int
    benign: int
    dirs: object  # (decoder layers, hidden) unit directions, not yet orthogonal to earlier rounds'
    norms: object  # (decoder layers,) un-normalised mean-difference norms
    groups: list = field(default_factory=list)  # (phrasing, prompts, (decoder layers, hidden) mean difference)


class _Abliteration:
    """The model, its prompts and settings; estimation rounds, measuring and search on it (one job's state)."""

    def __init__(self, model, tok, adapter, *, harmful, benign, eval_h, eval_b, position, batch_size, reply_tokens,
                 target, safety, phrasings, max_kl, warnings, refusal_filter=True, budget=None, redispatch=None,
                 progress=False, log=quiet):
        from ..data import pad_id

        self.model, self.tok, self.adapter = model, tok, adapter
        self.budget, self.redispatch = budget, redispatch
        self.harmful, self.benign, self.eval_h, self.eval_b = harmful, benign, eval_h, eval_b
        self.position, self.batch_size, self.reply_tokens, self.pad = position, batch_size, reply_tokens, pad_id(tok)
        self.target, self.safety, self.phrasings, self.max_kl = target, safety, phrasings, max_kl
        self.warnings, self.refusal_filter, self.progress, self.log = warnings, refusal_filter, progress, log
        self.reference = None  # evaluation benign first-token log-probs of the original (measure(original=True))
        self._capture_reference = None  # capture benign first-token log-probs of the original (round 1's replies)
        self.over_kl: str | None = None  # why the last abliteration stopped a round early, if it did

    def statistics(self, r: int) -> _Stats | None:
        """Round ``r``'s directions on the model as it is now, from the harmful capture prompts it refuses and the
        benign ones it answers (Arditi et al.'s filter), per refusal phrasing; ``None`` for a later round with too
        few refusals left."""
        from collections import defaultdict

        from ..refusal import greedy_replies, is_refusal, phrasing
        from ..residual import directions

        self.log(f"Round {r}: the model's replies to {len(self.harmful)} harmful and {len(self.benign)} benign "
                 f"capture prompts ({self.reply_tokens} tokens each) ...")
        replies = self._replies(self.harmful, f"round {r} harmful replies")
        hs = [(s, phrasing(t) if self.phrasings > 1 else "all") for s, t in zip(self.harmful, replies) if is_refusal(t)]
        benign_replies = self._replies(self.benign, f"round {r} benign replies", logprobs=r == 1)
        if r == 1:  # the original model: the reference of a later round's KL
            benign_replies, self._capture_reference = benign_replies
        bs = [s for s, t in zip(self.benign, benign_replies) if not is_refusal(t)]
        refused, answered = len(hs), len(bs)
        if r > 1 and (refused < MIN_REFUSED or not bs):
            return None
        if r == 1 and not self.refusal_filter:  # every prompt, whatever the model replied
            hs, bs = [(s, "all") for s in self.harmful], self.benign
        elif r == 1:
            _check_refusals(refused, len(self.harmful), answered, len(self.benign), self.reply_tokens)
        by = defaultdict(list)
        for sample, key in hs:
            by[key].append(sample)
        mb = self._capture(bs, f"round {r} benign")
        means = {k: self._capture(g, f"round {r} harmful '{k}'") for k, g in by.items()}
        mh = sum(len(by[k]) * m for k, m in means.items()) / len(hs)
        dirs, norms = directions(mh, mb)
        groups = sorted(((k, len(g), means[k] - mb) for k, g in by.items() if len(g) >= MIN_PHRASING),
                        key=lambda x: -x[1]) or [("all", len(hs), mh - mb)]
        return _Stats(refused, len(self.harmful), answered, len(self.benign), dirs, norms, groups)

    def _replies(self, samples, desc: str, logprobs: bool = False):
        """Greedy replies; with ``logprobs`` also the first-token log-probabilities, ``(replies, (N, vocab))``:
        the generation's own where it computes in float32, else one engine pass."""
        from ..refusal import greedy_replies

        out = greedy_replies(self.model, self.tok, samples, self.reply_tokens, progress=self.progress, desc=desc,
                             first_logprobs=logprobs)
        if not logprobs:
            return out
        replies, lp = out
        return replies, lp if lp is not None else self._logprobs(samples, desc.replace("replies", "log-probs"))

    def _logprobs(self, samples, desc: str):
        from ..refusal import first_token_logprobs

        return first_token_logprobs(self.model, samples, batch_size=max(self.batch_size, 16), pad_id=self.pad,
                                    budget=self.budget, progress=self.progress, desc=desc)

    def _capture(self, samples, desc):
        from ..residual import capture

        return capture(self.model, self.adapter, samples, position=self.position, batch_size=self.batch_size,
                       pad_id=self.pad, budget=self.budget, progress=self.progress, desc=desc)

    def _directions(self, stats: _Stats, done: list[Round], source) -> tuple[object, dict[str, int]]:
        """Up to ``phrasings`` unit directions (k, L, H) from the round's phrasings, each orthogonal to the earlier
        rounds' and to those picked before it, the one with the most left after that first (single direction: the
        source layer's, on every layer)."""
        import numpy as np

        basis = [d for r in done for d in r.dirs]
        left = [(k, n, g if source is None else np.repeat(g[source][None], g.shape[0], axis=0))
                for k, n, g in stats.groups]
        picked, names = [], {}
        scale = max(np.linalg.norm(g, axis=1).sum() for _, _, g in left)
        while left and len(picked) < self.phrasings:
            rest = []
            for k, n, g in left:
                for q in basis:
                    g = g - np.sum(g * q, axis=1, keepdims=True) * q
                rest.append((k, n, g))
            j = int(np.argmax([np.linalg.norm(g, axis=1).sum() for _, _, g in rest]))
            k, n, g = rest.pop(j)
            size = np.linalg.norm(g, axis=1, keepdims=True)
            if picked and size.sum() <= 1e-6 * scale:
                break  # what is left lies in the span of the directions already picked
            picked.append(g / np.maximum(size, 1e-30))
            basis.append(picked[-1])
            names[k] = n
            left = rest
        return np.stack(picked), names

    def abliterate(self, first: _Stats, layers, weight, source, rounds: int, on_round=None):
        """Up to ``rounds`` rounds (the first from ``first``): each measures its directions on the model as the
        earlier rounds left it, then puts the original weights back and removes every round's directions from them
        at once (a quantized writer is rounded once, not once a round) from the writers of ``layers`` (and, single
        direction, the embedding). A later round that takes the capture benign prompts' first-token KL over
        ``max_kl`` is undone and ends the rounds. Returns ``(rounds done, touched, undo)``; ``on_round(rounds done
        so far)`` after each."""
        from ..refusal import mean_kl
        from ..rewrite.abliterate import restore

        done, touched, undo = [], {}, []
        self.over_kl = None
        for r in range(1, rounds + 1):
            stats = first if r == 1 else self.statistics(r)
            if stats is None:
                break
            dirs, names = self._directions(stats, done, source)
            norm = float(stats.norms.max() if source is None else stats.norms[source])
            done.append(Round(stats.refused, stats.harmful, stats.answered, stats.benign, norm, dirs, names))
            restore(undo)
            touched, undo = self.apply(done, layers, weight, source)
            if r > 1:
                kl = mean_kl(self._capture_reference, self._logprobs(self.benign, f"round {r} benign KL"))
                if kl > self.max_kl:
                    self.over_kl = (f"round {r} took the capture benign prompts' KL to {kl:.3f}, over "
                                    f"{param('max_kl')} {self.max_kl:g}; it was undone and the rounds stopped there.")
                    done.pop()
                    restore(undo)
                    touched, undo = self.apply(done, layers, weight, source)
                    break
            if on_round is not None:
                on_round(done)
        return done, touched, undo

    def apply(self, done: list[Round], layers, weight, source):
        """Remove all of ``done``'s directions from the model as it is; returns ``(touched, undo)``."""
        import numpy as np

        from ..rewrite.abliterate import apply

        stack = np.concatenate([r.dirs for r in done])
        out = apply(self.adapter, stack, layers, target=self.target, weight=weight, safety=self.safety,
                    embed=None if source is None else stack[:, source])
        if self.redispatch is not None:  # dequantized experts kept by the dispatch hold the old weights
            self.redispatch()
        return out

    def measure(self, layers, weight, rounds=0, source=None, original: bool = False) -> Trial:
        from ..refusal import mean_kl, refusal_rate

        which = "the original model" if original else "the abliterated model"
        self.log(f"Measuring {which} on {len(self.eval_h)} harmful and {len(self.eval_b)} benign evaluation "
                 "prompts ...")
        harmful = refusal_rate(self._replies(self.eval_h, "evaluation harmful replies"))
        benign, lp = self._replies(self.eval_b, "evaluation benign replies", logprobs=True)
        if original:
            self.reference = lp
        kl = 0.0 if original else mean_kl(self.reference, lp)
        return Trial(layers, weight, harmful, refusal_rate(benign), kl, rounds, source)

    def search(self, first: _Stats, candidates, rounds: int, progress: bool):
        """Every candidate (layers, weight, source) through up to ``rounds`` rounds, measured after each (one trial
        and one progress step each), the model restored in between. Returns ``(trials, the rounds behind each)``."""
        from ..rewrite.abliterate import restore

        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(candidates) * rounds, unit="trial", desc="search", dynamic_ncols=True)
        trials, kept, log = [], [], self.log
        self.log = quiet  # the search bar says what each trial does
        try:
            for lay, w, src in candidates:
                def measured(done, lay=lay, w=w, src=src):
                    trials.append(self.measure(lay, w, len(done), src))
                    kept.append(list(done))
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(refusal=f"{trials[-1].harmful_refusal:.0%}", kl=f"{trials[-1].benign_kl:.3f}")

                _, _, undo = self.abliterate(first, lay, w, src, rounds, on_round=measured)
                restore(undo)
        finally:
            self.log = log
            if bar is not None:
                bar.close()
        return trials, kept


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
        job = _Abliteration(
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
            trials, kept = job.search(first, _candidates(chosen, norms, float(weight), source, search), rounds,
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
