"""Abliteration's search over the model (what ``mlx-fun abliterate`` does between loading and writing): estimation
rounds, refusal-phrasing grouping, measuring and the settings search, beside the projection
(:mod:`mlx_fun.rewrite.abliterate`).

Capture (:mod:`mlx_fun.observe.residual`) over the harmful prompts the model refuses and the benign ones it answers
(Arditi et al.'s filter, :func:`mlx_fun.observe.refusal.is_refusal`) → per-layer directions; a round takes one direction per
refusal **phrasing** (:func:`mlx_fun.observe.refusal.phrasing`; up to ``phrasings``, orthonormal), each further round
measures them again on the model abliterated so far and removes them too; a round that takes the first-token KL
on the held-out benign prompts (drawn beside the capture ones, never fitted on: ``kl_holdout``) over ``max_kl`` is
undone (a first round of several phrasings' directions that does falls back to one direction from all refused
prompts), and the search keeps the fewest refusals under ``max_kl`` on the same prompts. Every round starts from
the original weights, so a quantized model is rounded once. Every forward (captures, first-token log-probs) runs
through :mod:`mlx_fun.model.engine` within the job's token budget; the greedy replies are mlx-lm's ``BatchGenerator`` and hand back their first-token
log-probs, so measuring a model's refusals and its KL is one generation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import UserError, param


def quiet(_line: str) -> None:
    """No status lines (the job passes its own ``log``)."""


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
    held_out_kl: float = 0.0  # first-token KL on the held-out benign prompts (Prompts.kl_b): what max_kl bounds

    def row(self) -> dict:
        return {"layers": self.layers, "weight": self.weight, "direction_layer": self.direction_layer,
                "rounds": self.rounds, "harmful_refusal": round(self.harmful_refusal, 4),
                "benign_refusal": round(self.benign_refusal, 4), "benign_kl": round(self.benign_kl, 4),
                "held_out_kl": round(self.held_out_kl, 4)}


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


def check_refusals(refused: int, harmful: int, answered: int, benign: int, reply_tokens: int) -> None:
    """Arditi et al.'s filter keeps the harmful prompts the model refuses and the benign ones it answers: with none
    on one side there is no refusal to measure (a model that does not refuse has nothing to abliterate)."""
    from .abliterate_options import switched_off

    off = switched_off("refusal_filter")
    if not refused:
        raise UserError(f"the model refuses none of the {harmful} harmful capture prompts (0.0% of its first "
                        f"{reply_tokens}-token replies open like a refusal), so there is no refusal to remove and "
                        f"nothing was written; pass prompts this model refuses to {param('harmful_dataset')} (try one "
                        f"with `mlx-fun smoke-test`), or {off} to take the direction from every prompt anyway.")
    if not answered:
        raise UserError(f"the model refuses all {benign} benign capture prompts (100.0%; harmful: {refused} of "
                        f"{harmful}, {refused / harmful:.1%}), so there is nothing to compare its refusals with and "
                        f"nothing was written; pass prompts it answers to {param('benign_dataset')}, or {off}.")


def candidates(chosen: list[int], norms, weight: float, source: int | None, n: int
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
class Stats:
    """What one round measured on the model as it was: the prompts it used, the raw per-layer directions of all
    refused prompts, and each phrasing's un-normalised mean difference."""
    refused: int
    harmful: int
    answered: int
    benign: int
    dirs: object  # (decoder layers, hidden) unit directions, not yet orthogonal to earlier rounds'
    norms: object  # (decoder layers,) un-normalised mean-difference norms
    groups: list = field(default_factory=list)  # (phrasing, prompts, (decoder layers, hidden) mean difference)


@dataclass
class Prompts:
    """The tokenized prompts of one abliteration: the harmful and benign capture prompts (the directions), the
    harmful and benign evaluation prompts (the refusal rates and the benign KL), and the benign prompts held out of
    the directions (``kl_b``: where ``max_kl`` is checked; empty: on the benign capture prompts)."""
    harmful: list
    benign: list
    eval_h: list
    eval_b: list
    kl_b: list = field(default_factory=list)


class Abliteration:
    """The model, its prompts and settings; estimation rounds, measuring and search on it (one job's state).
    ``loaded``: the job's loaded model (:class:`mlx_fun.jobs.common.Loaded`: model, tokenizer, adapter, the dispatch
    report and the token budget of every forward); ``estimate`` / ``projection`` / ``evaluation``: the job's option
    groups (:mod:`mlx_fun.rewrite.abliterate_options`; ``projection.target`` and its safety map's routed experts are
    what the projection touches); ``calibration``: its ``batch_size`` (captures); ``settings``: the run settings
    (progress bars; the dispatch installed afresh after a projection where it keeps dequantized experts)."""

    def __init__(self, loaded, prompts: Prompts, *, estimate, projection, evaluation, calibration, settings,
                 warnings: list[str], log=quiet):
        from ..datasets.samples import pad_id

        self.model, self.tok, self.adapter = loaded.model, loaded.tokenizer, loaded.adapter
        self.budget = loaded.budget
        self.redispatch = ((lambda: redispatch(self.model, settings))
                           if loaded.dispatch is not None and loaded.dispatch.cached_layers else None)
        self.harmful, self.benign = prompts.harmful, prompts.benign
        self.eval_h, self.eval_b = prompts.eval_h, prompts.eval_b
        self.kl_b = prompts.kl_b or prompts.benign  # where max_kl is checked (the capture prompts: none held out)
        self.kl_set = (f"{len(prompts.kl_b)} held-out benign prompts" if prompts.kl_b
                       else f"{len(prompts.benign)} benign capture prompts (none held out)")
        self.position, self.phrasings = estimate.extraction_position, estimate.phrasings
        self.refusal_filter = estimate.refusal_filter
        self.reply_tokens, self.max_kl = evaluation.reply_tokens, float(evaluation.max_kl)
        self.batch_size, self.pad = calibration.batch_size, pad_id(self.tok)
        self.target, self.safety = projection.target, safety_experts(self.adapter, projection)
        self.warnings, self.progress, self.log = warnings, settings.progress, log
        self.reference = None  # evaluation benign first-token log-probs of the original (measure(original=True))
        self._bound_reference = None  # the original's first-token log-probs on kl_b (statistics(1))
        self.over_kl: str | None = None  # why the last abliteration stopped a round early, if it did
        self.fallback: str | None = None  # why its first round took one direction where it had several

    def statistics(self, r: int) -> Stats | None:
        """Round ``r``'s directions on the model as it is now, from the harmful capture prompts it refuses and the
        benign ones it answers (Arditi et al.'s filter), per refusal phrasing; ``None`` for a later round with too
        few refusals left."""
        from collections import defaultdict

        from ..observe.refusal import is_refusal, phrasing
        from ..observe.residual import directions

        self.log(f"Round {r}: the model's replies to {len(self.harmful)} harmful and {len(self.benign)} benign "
                 f"capture prompts ({self.reply_tokens} tokens each) ...")
        replies = self._replies(self.harmful, f"round {r} harmful replies")
        hs = [(s, phrasing(t) if self.phrasings > 1 else "all") for s, t in zip(self.harmful, replies) if is_refusal(t)]
        own = r == 1 and self.kl_b is self.benign  # no prompts held out: the replies' own log-probs are the reference
        benign_replies = self._replies(self.benign, f"round {r} benign replies", logprobs=own)
        if own:
            benign_replies, self._bound_reference = benign_replies
        elif r == 1:  # the original model: the reference of the held-out KL
            self._bound_reference = self._logprobs(self.kl_b, "held-out benign log-probs")
        bs = [s for s, t in zip(self.benign, benign_replies) if not is_refusal(t)]
        refused, answered = len(hs), len(bs)
        if r > 1 and (refused < MIN_REFUSED or not bs):
            return None
        if r == 1 and not self.refusal_filter:  # every prompt, whatever the model replied
            hs, bs = [(s, "all") for s in self.harmful], self.benign
        elif r == 1:
            check_refusals(refused, len(self.harmful), answered, len(self.benign), self.reply_tokens)
        by = defaultdict(list)
        for sample, key in hs:
            by[key].append(sample)
        mb = self._capture(bs, f"round {r} benign")
        means = {k: self._capture(g, f"round {r} harmful '{k}'") for k, g in by.items()}
        mh = sum(len(by[k]) * m for k, m in means.items()) / len(hs)
        dirs, norms = directions(mh, mb)
        groups = sorted(((k, len(g), means[k] - mb) for k, g in by.items() if len(g) >= MIN_PHRASING),
                        key=lambda x: -x[1]) or [("all", len(hs), mh - mb)]
        return Stats(refused, len(self.harmful), answered, len(self.benign), dirs, norms, groups)

    def _replies(self, samples, desc: str, logprobs: bool = False):
        """Greedy replies; with ``logprobs`` also the first-token log-probabilities, ``(replies, (N, vocab))``:
        the generation's own where it computes in float32, else one engine pass."""
        out = self._greedy(samples, desc, logprobs)
        if not logprobs:
            return out
        replies, lp = out
        return replies, lp if lp is not None else self._logprobs(samples, desc.replace("replies", "log-probs"))

    def _greedy(self, samples, desc: str, logprobs: bool):
        from ..observe.refusal import greedy_replies

        return greedy_replies(self.model, self.tok, samples, self.reply_tokens, progress=self.progress, desc=desc,
                              first_logprobs=logprobs, budget=self.budget, until_decided=True)

    def _logprobs(self, samples, desc: str):
        from ..observe.refusal import first_token_logprobs

        return first_token_logprobs(self.model, samples, batch_size=max(self.batch_size, 16), pad_id=self.pad,
                                    budget=self.budget, progress=self.progress, desc=desc)

    def _capture(self, samples, desc):
        from ..observe.residual import capture

        return capture(self.model, self.adapter, samples, position=self.position, batch_size=self.batch_size,
                       pad_id=self.pad, budget=self.budget, progress=self.progress, desc=desc)

    def _directions(self, stats: Stats, done: list[Round], source) -> tuple[object, dict[str, int]]:
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

    def abliterate(self, first: Stats, layers, weight, source, rounds: int, on_round=None):
        """Up to ``rounds`` rounds (the first from ``first``): each measures its directions on the model as the
        earlier rounds left it, then puts the original weights back and removes every round's directions from them
        at once (a quantized writer is rounded once, not once a round) from the writers of ``layers`` (and, single
        direction, the embedding). A later round that takes the capture benign prompts' first-token KL over
        ``max_kl`` is undone and ends the rounds. Returns ``(rounds done, touched, undo)``; ``on_round(rounds done
        so far)`` after each."""
        done, touched, undo = [], {}, []
        self.over_kl = self.fallback = None
        for r in range(1, rounds + 1):
            stats = first if r == 1 else self.statistics(r)
            if stats is None:
                break
            dirs, names = self._directions(stats, done, source)
            norm = float(stats.norms.max() if source is None else stats.norms[source])
            done.append(Round(stats.refused, stats.harmful, stats.answered, stats.benign, norm, dirs, names))
            self.restore(undo)
            touched, undo = self.apply(done, layers, weight, source)
            if r == 1 and len(dirs) > 1:
                touched, undo = self._one_direction_if_over(stats, done, layers, weight, source, undo) or (
                    touched, undo)
            if r > 1:
                kl = self._bound_kl(r)
                if kl > self.max_kl:
                    self.over_kl = (f"round {r} took the first-token KL on the {self.kl_set} to {kl:.3f}, over "
                                    f"{param('max_kl')} {self.max_kl:g}; it was undone and the rounds stopped there.")
                    done.pop()
                    self.restore(undo)
                    touched, undo = self.apply(done, layers, weight, source)
                    break
            if on_round is not None:
                on_round(done)
        return done, touched, undo

    def _one_direction_if_over(self, stats: Stats, done: list[Round], layers, weight, source, undo):
        """Round 1 with one direction per phrasing: when that takes the held-out benign prompts' first-token KL over
        ``max_kl``, it is replaced by one direction from all refused prompts (the phrasings' directions together
        can remove more than refusing). Returns ``(touched, undo)`` where it replaced, else ``None``."""
        from dataclasses import replace

        kl = self._bound_kl(1)
        if kl <= self.max_kl:
            return None
        one = replace(stats, groups=[("all", stats.refused, stats.dirs)])
        dirs, names = self._directions(one, [], source)
        done[0] = replace(done[0], dirs=dirs, phrasings=names)
        self.restore(undo)
        self.fallback = (f"round 1's {len(stats.groups)} directions (one per refusal phrasing) took the first-token "
                         f"KL on the {self.kl_set} to {kl:.3f}, over {param('max_kl')} {self.max_kl:g}; one direction "
                         "from all refused prompts was removed instead.")
        return self.apply(done, layers, weight, source)

    def _bound_kl(self, r: int) -> float:
        """Round ``r``'s check of ``max_kl``: :meth:`held_out_kl` (a phase of its own when streamed)."""
        return self.held_out_kl(f"round {r} held-out KL")

    def held_out_kl(self, desc: str) -> float:
        """The first-token KL of the model as it is now from the original on the prompts ``max_kl`` bounds
        (``kl_b``: held out of the directions, unless none were)."""
        from ..observe.refusal import mean_kl

        return mean_kl(self._bound_reference, self._logprobs(self.kl_b, desc))

    def apply(self, done: list[Round], layers, weight, source):
        """Remove all of ``done``'s directions from the model as it is; returns ``(touched, undo)``."""
        import numpy as np

        from .abliterate import apply

        stack = np.concatenate([r.dirs for r in done])
        out = apply(self.adapter, stack, layers, target=self.target, weight=weight, safety=self.safety,
                    embed=None if source is None else stack[:, source])
        if self.redispatch is not None:  # dequantized experts kept by the dispatch hold the old weights
            self.redispatch()
        return out

    def restore(self, undo: list) -> None:
        """Put back what :meth:`apply` replaced (:func:`mlx_fun.rewrite.abliterate.restore`)."""
        from .abliterate import restore

        restore(undo)

    def measure(self, layers, weight, rounds=0, source=None, original: bool = False) -> Trial:
        from ..observe.refusal import mean_kl, refusal_rate

        which = "the original model" if original else "the abliterated model"
        self.log(f"Measuring {which} on {len(self.eval_h)} harmful and {len(self.eval_b)} benign evaluation "
                 "prompts ...")
        harmful = refusal_rate(self._replies(self.eval_h, "evaluation harmful replies"))
        benign, lp = self._replies(self.eval_b, "evaluation benign replies", logprobs=True)
        if original:
            self.reference = lp
        kl = 0.0 if original else mean_kl(self.reference, lp)
        bound = 0.0 if original else self.held_out_kl("held-out benign KL")
        return Trial(layers, weight, harmful, refusal_rate(benign), kl, rounds, source, bound)

    def search(self, first: Stats, candidates, rounds: int, progress: bool):
        """Every candidate (layers, weight, source) through up to ``rounds`` rounds, measured after each (one trial
        and one progress step each), the model restored in between. Returns ``(trials, the rounds behind each)``."""
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
                self.restore(undo)
        finally:
            self.log = log
            if bar is not None:
                bar.close()
        return trials, kept


def safety_experts(adapter, projection) -> dict[int, list[int]] | None:
    """Decoder layer → the safety report's routed experts, for ``projection.target == "safety-experts"``."""
    from ..experts.expert_files import load_report_experts
    from .abliterate import latent_experts

    if projection.target != "safety-experts":
        return None
    if latent_experts(adapter):
        raise UserError(f"model_type '{adapter.model_type}' runs its routed experts in a latent space, so no "
                        f"expert alone writes the residual stream; use {param('target')} all or dense-only.")
    moe = adapter.moe_layers()
    sets = load_report_experts(projection.safety_map, "safety", moe, adapter.num_experts)
    return {moe[p]: sorted(e) for p, e in sets.items() if e}


def redispatch(model, settings) -> None:
    """Install the dispatch afresh (its dequantized experts from the weights as they are now)."""
    from ..dispatch.experts import remove

    remove(model)
    settings.apply(model)
