"""Differential routing analysis (SAFEx / SteerMoE style): how each expert's routing differs between two datasets.

One :class:`RoutingTap` per dataset, on the hooked MoE call and the forward engine (padding excluded, float64,
fed once per batch; the counts are ``collect``'s own), accumulates per layer × expert: how many tokens select the expert (``count``), the sum of its
mixing weight (``weight_sum``, 0 where not selected) and the sum of its raw router logit (``logit_sum``, every
token). Divided by the token count: **activation rate**, **mean router weight**, **mean gate logit**.

:func:`differential` compares dataset A (harmful / domain) with B (benign / general): each difference
(A − B) is scaled by its standard deviation over all layers × experts and the three are averaged into the
**composite** score; the activation-rate difference is also SteerMoE's **risk difference**. :func:`classify`
ranks every layer × expert cell by one of them (:data:`RANKED_BY`: the safety scan by the risk difference, as
SteerMoE ranks its safety experts over all layers; the domain scan by the composite, which ``amplify`` scales its
boost by) and puts the cells at or above the ``p``-th percentile *and* more active on A in the "A" group (HCDG /
domain experts), those at or below the ``(100 − p)``-th percentile and more active on B in the "B" group (HRCG /
general experts). :func:`report` writes both scans' JSON, the format :mod:`mlx_fun.experts.expert_files` reads
(``prune --safety-map / --domain-map``, steering).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from ..model import engine, moe_hook
from ..adapters.base import MoEAdapter
from .collect import SaliencyTap, check_streamable
from .saliency import SaliencyAccumulator

REPORT_VERSION = 1
#: the score each scan's groups are ranked by (see the module docstring; docs/benchmarks/parity.md for SteerMoE's)
RANKED_BY = {"safety": "risk_difference", "domain": "composite"}


class RoutingTap(SaliencyTap):
    """Per-dataset routing sums of every MoE layer (see the module docstring): ``collect``'s frequency counting
    (:class:`mlx_fun.observe.collect.SaliencyTap` into a :class:`SaliencyAccumulator`) plus the gate-logit sums."""

    def __init__(self, adapter: MoEAdapter):
        super().__init__(norms=False)
        self.acc = SaliencyAccumulator.for_adapter(adapter)
        self.logit_sum = np.zeros_like(self.acc.freq)
        self.logits: list[tuple[int, mx.array]] = []

    count = property(lambda self: self.acc.freq)  # tokens selecting the expert
    weight_sum = property(lambda self: self.acc.weighted_freq_sum)  # Σ mixing weight where selected
    tokens = property(lambda self: self.acc.total_tokens)

    def __call__(self, layer, inds, weights, logits, y):
        super().__call__(layer, inds, weights, logits, y)
        self.logits.append((layer, logits.astype(mx.float32).reshape(-1, logits.shape[-1])))

    def flush(self, valid: np.ndarray | None = None, evaluate=mx.eval, *, into: RoutingTap | None = None,
              count_tokens: bool = True) -> int:
        """Evaluate what the tap recorded since the last flush and add it to ``into``'s sums (default: its own);
        ``valid``: the batch's real tokens. ``count_tokens=False``: the tokens are not added to ``into.tokens`` (a
        streamed scan flushes each batch once per layer, its tokens counted once beforehand)."""
        into = self if into is None else into
        logits, self.logits = self.logits, []
        n = super().flush(into.acc, valid, evaluate=lambda *a: evaluate(*a, *[lg for _, lg in logits]))
        if count_tokens:
            into.acc.total_tokens += n
        for layer, lg in logits:
            lg = np.array(lg, dtype=np.float64)
            into.logit_sum[layer] += (lg if valid is None else lg[valid.reshape(-1)]).sum(axis=0)
        return n

    def means(self) -> dict[str, np.ndarray]:
        t = max(self.tokens, 1)
        return {"activation_rate": self.count / t, "mean_router_weight": self.weight_sum / t,
                "mean_gate_logit": self.logit_sum / t}


def scan(model, adapter: MoEAdapter, samples, *, batch_size: int = 1, pad_id: int = 0, token_budget=None,
         progress: bool = False, desc: str = "scan") -> RoutingTap:
    """Run ``samples`` through the hooked model on the forward engine and return the dataset's tap."""
    tap = RoutingTap(adapter)

    def on_chunk(chunk, _output):
        tap.flush(None if chunk.valid.all() else chunk.valid, evaluate=chunk.eval)

    with moe_hook.hooked(adapter, [tap]):
        engine.run(model, samples, on_chunk, batch_size=batch_size, pad_id=pad_id, budget=token_budget,
                   progress=progress, desc=desc)
    return tap


def scan_streamed(model, adapter: MoEAdapter, datasets: Sequence[Sequence[Sequence[int]]], *, batch_size: int = 1,
                  pad_id: int = 0, token_budget: int | None = None, progress: bool = False, desc: str = "scan",
                  refusal: str = "a streamed scan", spill=None, checkpoint=None, log=None) -> list[RoutingTap]:
    """:func:`scan`'s tap of every sample set in ``datasets``, with one decoder layer's weights in memory at a
    time: all sets' hidden states are carried together through the layers by
    :class:`mlx_fun.model.layered.LayerDriver` (the same length-bucketed, right-padded batches, each set batched
    apart), each layer run once on every batch through the hooks and then released (a lazily loaded model reads
    each layer's weights from its files once for all the sets). Counts equal the in-memory scans' exactly, sums
    within float rounding (they are added per layer rather than per forward). A family whose layers read state
    other layers hand on is refused in one line (``refusal`` names the run). ``spill``: a directory to carry the
    hidden states in files instead of memory (the driver's ``spill``; removed at the end). ``checkpoint``
    (:class:`mlx_fun.observe.checkpoint.StreamCheckpoint`): the hidden states and every set's sums saved after a
    layer when due, and resumed from when it holds a layer (``log`` says where)."""
    from ..errors import param
    from ..model.layered import LayerDriver
    from .checkpoint import carried, resume

    check_streamable(adapter, run=refusal, instead=f"run it without {param('stream_layers')}")
    first, *more = datasets
    taps = [RoutingTap(adapter) for _ in datasets]
    recorder = RoutingTap(adapter)  # the hook: each batch's layer call, added to its own set's tap

    def after_batch(i, batch, out):  # the layer's routing, evaluated with its output
        recorder.flush(None if batch.valid.all() else batch.valid, evaluate=lambda *a: mx.eval(out, *a),
                       into=taps[batch.group], count_tokens=False)
        return ()

    with LayerDriver(model, adapter, first, batch_size=batch_size, pad_id=pad_id, token_budget=token_budget,
                     more=more, spill=spill) as driver:
        for group, tap in enumerate(taps):
            tap.acc.total_tokens = driver.group_tokens(group)
        last = adapter.moe_layers()[-1]
        start, resumed = resume(checkpoint, driver, layers=last + 1, log=log)
        if resumed is not None:
            _restore_sums(taps, resumed.arrays)

        def on_done(i):
            if checkpoint is not None and i < last and checkpoint.due():
                checkpoint.save(i, carried(driver), arrays=_sums(taps))

        with moe_hook.hooked(adapter, [recorder]):
            driver.run(release=True, start=start, after_batch=after_batch, on_done=on_done, progress=progress,
                       desc=desc)
    return taps


def _sums(taps: Sequence[RoutingTap]) -> dict[str, np.ndarray]:
    """Every set's routing sums by name (``t<set>.<key>``), for a checkpoint."""
    from .saliency import ARRAY_KEYS

    out = {}
    for g, tap in enumerate(taps):
        out.update({f"t{g}.{key}": getattr(tap.acc, key) for key in ARRAY_KEYS})
        out[f"t{g}.logit_sum"] = tap.logit_sum
    return out


def _restore_sums(taps: Sequence[RoutingTap], arrays: dict[str, np.ndarray]) -> None:
    """Every set's routing sums from a checkpoint's arrays (:func:`_sums`' names)."""
    from .saliency import ARRAY_KEYS

    for g, tap in enumerate(taps):
        for key in ARRAY_KEYS:
            setattr(tap.acc, key, arrays[f"t{g}.{key}"])
        tap.logit_sum = arrays[f"t{g}.logit_sum"]


def _scaled(x: np.ndarray) -> np.ndarray:
    sd = x.std()
    return x / sd if sd > 0 else np.zeros_like(x)


def differential(a: RoutingTap, b: RoutingTap) -> dict[str, np.ndarray]:
    ma, mb = a.means(), b.means()
    deltas = {k: ma[k] - mb[k] for k in ma}
    composite = np.mean([_scaled(d) for d in deltas.values()], axis=0)
    return {"composite": composite, "risk_difference": deltas["activation_rate"],
            "delta_router_weight": deltas["mean_router_weight"], "delta_gate_logit": deltas["mean_gate_logit"]}


@dataclass
class Groups:
    a: dict[str, list[int]]  # more active on A (HCDG / domain experts), keyed by decoder-layer index
    b: dict[str, list[int]]  # more active on B (HRCG / general experts)
    threshold_a: float
    threshold_b: float


def classify(diff: dict[str, np.ndarray], moe_layer_indices: list[int], percentile: float, *,
             by: str) -> Groups:
    """The two groups by the ``by`` score's ``percentile``-th / ``(100 − percentile)``-th percentile over all
    cells, each side only where the risk difference has its sign."""
    score, risk = diff[by], diff["risk_difference"]
    hi, lo = float(np.percentile(score, percentile)), float(np.percentile(score, 100.0 - percentile))

    def groups(mask):
        return {str(layer): [int(e) for e in np.flatnonzero(mask[pos])]
                for pos, layer in enumerate(moe_layer_indices) if mask[pos].any()}

    return Groups(groups((score >= hi) & (risk > 0)), groups((score <= lo) & (risk < 0)), hi, lo)


def report(kind: str, a: RoutingTap, b: RoutingTap, adapter: MoEAdapter, *, percentile: float,
           datasets: dict, extra: dict | None = None) -> dict:
    """The ``safety_report.json`` (kind ``safety``) or ``domain_report.json`` (``domain``) document (the expert
    count is the taps', which a streamed scan's emptied layers no longer tell)."""
    layers = adapter.moe_layers()
    diff = differential(a, b)
    by = RANKED_BY[kind]
    g = classify(diff, layers, percentile, by=by)
    names = ("harmful", "benign") if kind == "safety" else ("domain", "general")
    out = {"format": f"mlx-fun {kind} report", "version": REPORT_VERSION, "model_type": adapter.model_type,
           "num_experts": int(a.count.shape[1]), "top_k": adapter.top_k, "moe_layer_indices": layers,
           "threshold_percentile": percentile, "ranked_by": by, **(extra or {}), "datasets": datasets}
    if kind == "safety":
        critical = {k: sorted(set(g.a.get(k, [])) | set(g.b.get(k, []))) for k in sorted(set(g.a) | set(g.b), key=int)}
        out.update(hcdg=g.a, hrcg=g.b, safety_critical=critical,
                   thresholds={"hcdg_risk_difference_at_least": g.threshold_a,
                               "hrcg_risk_difference_at_most": g.threshold_b})
    else:
        out.update(domain_experts=g.a, general_experts=g.b,
                   thresholds={"domain_composite_at_least": g.threshold_a, "general_composite_at_most": g.threshold_b})
    out["scores"] = {k: np.round(v, 6).tolist() for k, v in diff.items()}
    out["per_dataset"] = {name: {k: np.round(v, 6).tolist() for k, v in tap.means().items()} | {"tokens": tap.tokens}
                          for name, tap in zip(names, (a, b))}
    return out
