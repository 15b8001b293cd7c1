"""REAM: merge every MoE layer's experts into fewer centroids instead of dropping them.

Per MoE layer (position ``pos`` among ``adapter.moe_layers()``):

1. **Centroids** — the experts that stay: the ``E − n_prune`` most salient (the ``bottom`` strategy of
   :mod:`mlx_fun.experts.selection`, with group balance as in prune) or the kept experts of an expert list.
   **Saliency** (``Ream.saliency_source``): ``layerwise`` (the default, REAM's own,
   :mod:`mlx_fun.rewrite.ream_saliency`): each layer's mean ``p² ‖y‖`` over its routed tokens, measured in step 2
   on the hidden states of the already merged layers, so each layer's centroids are chosen as it is reached
   (:func:`layer_centroids`); ``file``: a collect file's scores, all layers ranked up front
   (:func:`select_centroids`: model-wide selection and ``--ignore-experts`` as in prune). The saliency also
   orders the centroids in step 4 and weights the averages in step 6; ``ream_metadata.json`` records it per
   layer (``saliency``) with its ``saliency_source``.
2. **Capture** — calibration tokens reach the layer through the already merged layers before it (see
   *Sequential* below). A :class:`ReamCaptureTap` on the hooked MoE call (``moe_hook``; routing is never
   re-implemented) keeps the block's input ``x``, raw router logits and routing of a fixed random subset of
   tokens (``max_similarity_tokens``; the first ``max_alignment_tokens`` of them also serve alignment).
3. **Similarity** (E × E) — every expert is run on the captured tokens with the block's own ``SwitchGLU``
   (quantized or not) giving ``y[t, e]``; ``p = softmax(logits)`` of the raw router logits is the router's
   probability of every expert (for sigmoid routers — DeepSeek, MiniMax — the same normalised preference; no
   selection is replayed, the hooked call has already routed).

   - ``gated``:   ½ · (cos(mean_t p[t,e]·y[t,e], mean_t p[t,f]·y[t,f]) + corr(logits[:, e], logits[:, f]))
   - ``average``: ½ · (cos(mean_t y[t,e], mean_t y[t,f]) + corr(logits[:, e], logits[:, f]))

   ``corr`` is the cosine of the token-centred logit columns (Pearson correlation over the tokens): how alike
   the router treats the two experts.
4. **Grouping** (:func:`group_experts`) — centroids in descending saliency each claim their most similar
   unassigned non-centroid experts until the group (centroid included) has ``max_group_size`` members. No
   group grows past ``max_group_size``, so ``centroids × max_group_size`` must reach ``E``
   (:func:`check_group_room`; refused otherwise). The reference joins leftovers to their most similar centroid
   instead, past the maximum.
5. **Alignment** — each member's intermediate neurons are permuted onto the centroid's before averaging.
   Cost of pairing centroid neuron ``a`` with member neuron ``b`` = squared distance of their unit-normalised
   intermediate activations over the alignment tokens + squared distance of their unit-normalised weight
   features (gate row ‖ up row ‖ down column; fc1 row ‖ fc2 column for ``SwitchMLP`` experts), i.e. ``(2 − 2·cos_act) + (2 − 2·cos_feat)``. ``hungarian``
   solves the assignment exactly (``scipy.optimize.linear_sum_assignment``); ``greedy`` lets neurons in
   order of their best cost take their cheapest free partner (O(I²)); ``none`` keeps the identity.
6. **Merge** — saliency-weighted average of the aligned gate / up / down (or fc1 / fc2) weights and, where the family has
   them (gpt-oss), of the gate / up / down biases (gate and up biases are permuted with their rows). mlx-lm
   stores gpt-oss's interleaved ``gate_up_proj`` as separate ``gate_proj`` / ``up_proj`` (its ``sanitize``
   de-interleaves ``[..., ::2, :]`` / ``[..., 1::2, :]``), so neuron ``j`` of the fused layer is row ``j`` of
   both halves and one permutation moves the pair together; the saved model keeps mlx-lm's split layout,
   which ``mlx_lm.load`` reads as is. Weights are ``saliency / Σ saliency`` of the group (uniform when the
   whole group scores 0); a member with weight 0 contributes nothing, and a group whose only weighted
   member is its centroid keeps the centroid's tensors untouched (bit for bit, quantized or not).
7. **Router** — the centroid keeps its own router row (and correction bias); the members' rows are dropped,
   exactly as prune drops them. The group was formed from experts the router already treats alike (the
   logit-correlation half of the similarity), so the centroid's row routes the group's tokens; averaging
   rows would instead shift the logit scale that top-k selection, group-limited selection and correction
   biases were trained against, moving tokens between experts that were never merged. Keeping the row also
   makes "groups of one" exactly prune.

**Sequential, linear in depth.** Hidden states of all calibration samples are pushed through the model one
decoder layer at a time by the layered driver (:class:`mlx_fun.model.layered.LayerDriver`, on
:mod:`mlx_fun.model.layerwise`, which replays the arguments the model's own forward gives each layer, so masks of
every family are right). For a MoE layer the layer is run once with its original experts
— only the tap's arrays are evaluated, i.e. attention and router — then merged, then run again to produce the
next layer's input from the merged layer. Cost: about one forward pass over the calibration set (plus the
attention of MoE layers once more) and the per-layer merge work; never a full forward per layer.

**Streamed** (``merge --stream-layers``, :func:`mlx_fun.rewrite.merge_stream.run_streamed`): the same pass on a
lazily loaded model, one decoder layer's weights in memory at a time, each layer written to the checkpoint once
merged; a killed run resumes after the last checkpointed layer.

**Quantization kept.** A quantized projection is dequantized one expert at a time for merging and the merged
expert is re-quantized with the tensor's own bits, group size and mode (affine, mxfp4, nvfp4, with a fresh
per-expert global scale where the tensor has them). Experts not merged are sliced, never re-quantized. The
merged model has exactly the tensor shapes and dtypes of a pruned model with the same expert count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import mlx.core as mx
import numpy as np

from ..model import engine, moe_hook
from ..adapters.base import MoEAdapter, expert_projections
from ..errors import UserError, param
from ..model.layered import LayerDriver
from .weights import stored, write
from ..datasets.calibration import Calibration
from ..experts.selection import Selection
from .merge_options import ALIGNMENTS, SIMILARITY_MODES, Ream, check_max_group_size  # noqa: F401 - re-exported
from .prune import check_keep_map, prune_block, pruned_config
from .merge_align import merge_group, unit_rows
from .ream_saliency import LAYERWISE_METRIC, ReamSaliency, batch_of_tokens, routed_contributions, routed_saliency

if TYPE_CHECKING:
    from ..observe.checkpoint import StreamCheckpoint


# ================================================================================================ selection
def select_centroids(
    adapter: MoEAdapter,
    scores,
    n_prune: int,
    *,
    model_wide: bool = False,
    min_experts_per_layer: int = 1,
    ignore_experts=None,
    protected=None,
) -> dict[int, list[int]]:
    """The ``E − n_prune`` most salient experts of every MoE layer: ``{position: sorted centroids}``.

    The ``bottom`` strategy of :func:`mlx_fun.experts.selection.select_experts` with all its checks (≥ top_k kept,
    model-wide column sums, ignored / protected experts, group balance of group-limited routers).
    """
    from ..experts.selection import select_experts

    return select_experts(
        scores,
        n_prune,
        top_k=adapter.top_k,
        strategy="bottom",
        model_wide=model_wide,
        min_experts_per_layer=min_experts_per_layer,
        ignore_experts=ignore_experts,
        protected=protected,
        groups=adapter.groups,
        moe_layer_indices=adapter.moe_layers(),
    )


# ================================================================================================ capture
class ReamCaptureTap:
    """Keeps the MoE input, raw router logits and routing of the selected tokens of one layer (lazily), and, with
    ``saliency`` (:class:`~mlx_fun.rewrite.ream_saliency.ReamSaliency`), adds every token's ``p² ‖y‖`` to it.

    ``layer`` is the block position to capture (``None``: capture nothing); ``select`` the flat token
    positions (into the block's ``(N, D)`` view of its input) of the current batch (``None``: none of them);
    ``token_batches`` the saliency batch of each of the batch's tokens
    (:func:`~mlx_fun.rewrite.ream_saliency.batch_of_tokens`).
    """

    def __init__(self, saliency=None):
        self.layer: int | None = None
        self.select: mx.array | None = None
        self.saliency = saliency
        self.token_batches: np.ndarray | None = None
        self.records: list[tuple[mx.array, mx.array, mx.array, mx.array]] = []
        self._x = None

    def on_input(self, layer, h):
        if layer == self.layer:
            self._x = h

    def __call__(self, layer, inds, weights, logits, y):
        if layer != self.layer:
            return
        x, self._x = self._x, None
        sel, record, contrib = self.select, (), None
        if sel is not None:
            record = (
                x.reshape(-1, x.shape[-1])[sel],
                logits.reshape(-1, logits.shape[-1])[sel].astype(mx.float32),
                inds.reshape(-1, inds.shape[-1])[sel],
                weights.reshape(-1, weights.shape[-1])[sel].astype(mx.float32),
            )
        if self.saliency is not None:
            contrib = routed_contributions(inds, logits, y)
        # evaluated batch by batch: one batch's attention alive at a time, as in a plain forward (evaluating all
        # batches' captures at once in take() held every batch's attention scores together)
        mx.eval([*record, *([] if contrib is None else [contrib])])
        if record:
            self.records.append(record)
        if contrib is not None:
            self.saliency.add(self.token_batches, np.array(inds), np.array(contrib))

    def take(self):
        """``(x, logits, inds, weights)`` of everything captured since the last call, concatenated and evaluated."""
        records, self.records = self.records, []
        if not records:
            raise RuntimeError("the MoE block was not called on any selected token")
        out = tuple(mx.concatenate([r[i] for r in records], axis=0) for i in range(4))
        mx.eval(out)
        return out


# ================================================================================================ similarity
def cosine_matrix(vectors: np.ndarray) -> np.ndarray:
    """(E, E) cosine similarity of the rows of ``vectors`` (a zero row is similar to nothing)."""
    u = unit_rows(np.asarray(vectors, dtype=np.float64))
    return u @ u.T


def logit_similarity(logits: np.ndarray) -> np.ndarray:
    """(E, E) correlation of the router's logit columns over the tokens (cosine of the centred columns)."""
    L = np.asarray(logits, dtype=np.float64)
    L = L - L.mean(axis=0, keepdims=True)
    return cosine_matrix(L.T)


def expert_similarity(mean_outputs: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """½ (cosine of the per-expert mean outputs + logit-column correlation); see the module docstring."""
    return 0.5 * (cosine_matrix(mean_outputs) + logit_similarity(logits))


@dataclass
class DenseStats:
    mean_output: np.ndarray  # (E, D) mean_t y[t, e]
    mean_gated_output: np.ndarray  # (E, D) mean_t p[t, e] y[t, e]
    norms: np.ndarray  # (N, E) ‖y[t, e]‖


def dense_expert_stats(experts, x: mx.array, logits: mx.array, chunk_elems: int = 1 << 24) -> DenseStats:
    """Run every expert on every token of ``x`` (N, D) with the block's own SwitchGLU, a few experts at a time."""
    N, D = x.shape
    E = logits.shape[-1]
    probs = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)
    step = max(1, min(E, chunk_elems // max(1, N * D)))
    mean_y, mean_py, norms = [], [], []
    for start in range(0, E, step):
        ids = mx.arange(start, min(E, start + step), dtype=mx.uint32)
        idx = mx.broadcast_to(ids[None, :], (N, ids.size))
        y = experts(x, idx).astype(mx.float32)  # (N, c, D)
        p = probs[:, start : start + ids.size, None]
        parts = (y.mean(axis=0), (p * y).mean(axis=0), mx.linalg.norm(y, axis=-1))
        mx.eval(parts)
        mean_y.append(np.array(parts[0]))
        mean_py.append(np.array(parts[1]))
        norms.append(np.array(parts[2]))
    return DenseStats(np.concatenate(mean_y), np.concatenate(mean_py), np.concatenate(norms, axis=1))


# ================================================================================================ grouping
def _desc_order(values: np.ndarray, candidates) -> list[int]:
    """``candidates`` sorted by descending value (ties: lower index first)."""
    cand = np.asarray(list(candidates), dtype=np.int64)
    if cand.size == 0:
        return []
    return cand[np.lexsort((cand, -np.asarray(values, dtype=np.float64)[cand]))].tolist()


def check_group_room(n_kept: int, num_experts: int, max_group_size: int) -> None:
    """Every expert must find a group: ``n_kept`` centroids of at most ``max_group_size`` members hold them all,
    else a one-line ``UserError`` with the smallest size that does and the most experts that size allows merging."""
    check_max_group_size(max_group_size)
    if n_kept * max_group_size < num_experts:
        most = num_experts - -(-num_experts // max_group_size)
        raise UserError(f"{n_kept} centroids × {param('max_group_size')} {max_group_size} hold {n_kept * max_group_size} "
                        f"of the {num_experts} experts per layer, so {num_experts - n_kept * max_group_size} would "
                        f"fit in no group; pass {param('max_group_size')} {-(-num_experts // n_kept)} or more, or "
                        f"merge at most {most} experts per layer at this size (`mlx-fun prune` removes experts "
                        f"without merging).")


def group_experts(
    similarity: np.ndarray, saliency: np.ndarray, centroids: Sequence[int], max_group_size: int
) -> dict[int, list[int]]:
    """``{centroid: [centroid, members...]}`` covering every expert exactly once (see the module docstring).

    Centroids claim in descending saliency; each claims its most similar unassigned non-centroid experts
    until its group has ``max_group_size`` members (:func:`check_group_room`: there is room for all).
    """
    S = np.asarray(similarity, dtype=np.float64)
    E = S.shape[0]
    cents = [int(c) for c in centroids]
    if len(set(cents)) != len(cents) or any(not 0 <= c < E for c in cents) or not cents:
        raise ValueError(f"centroids must be distinct experts in [0, {E}), got {cents}")
    check_group_room(len(cents), E, max_group_size)
    groups = {c: [c] for c in _desc_order(saliency, cents)}
    unassigned = set(range(E)) - set(cents)
    for c, members in groups.items():
        room = max_group_size - 1
        if room <= 0 or not unassigned:
            continue
        take = _desc_order(S[c], unassigned)[:room]
        members.extend(take)
        unassigned.difference_update(take)
    return groups


# ================================================================================================ writing
def write_merged(adapter: MoEAdapter, block, kept: list[int], merged: dict[int, dict]) -> None:
    """Slice ``block`` to ``kept`` (sorted centroids; router rows of the centroids stay) and put the merged
    experts in place; experts not in ``merged`` keep their sliced tensors untouched."""
    prune_block(adapter, block, kept)
    if not merged:
        return
    experts = adapter.experts(block)
    pos_of = {e: j for j, e in enumerate(kept)}
    ins, out_name = expert_projections(experts)
    for name in (*ins, out_name):
        lin = getattr(experts, name)
        new_parts: dict[int, dict[str, mx.array]] = {}
        for e, w in merged.items():
            parts = stored(lin, w[name])
            if w[name + "_bias"] is not None and "bias" in lin:
                parts["bias"] = w[name + "_bias"].astype(lin["bias"].dtype)
            new_parts[pos_of[e]] = parts
        write(lin, new_parts)
    mx.eval(experts.parameters())


# ================================================================================================ the whole model
def _token_subsets(batches_valid: list[np.ndarray], n_capture: int, rng: np.random.Generator):
    """Pick ``n_capture`` random valid tokens; return their flat positions per batch and how many were picked."""
    flat = [np.flatnonzero(v.reshape(-1)) for v in batches_valid]
    total = sum(len(f) for f in flat)
    chosen = np.sort(rng.permutation(total)[:n_capture]) if n_capture < total else np.arange(total)
    out, offset = [], 0
    for f in flat:
        local = chosen[(chosen >= offset) & (chosen < offset + len(f))] - offset
        out.append(f[local])
        offset += len(f)
    return out, len(chosen)


def merge_model(model, adapter: MoEAdapter, samples: Sequence[Sequence[int]], *,
                keep_map: dict[int, list[int]] | None = None, saliency=None, selection: Selection = Selection(),
                ream: Ream = Ream(), calibration: Calibration = Calibration(max_samples=64, batch_size=8),
                pad_id: int = 0, token_budget: int | None = None, progress: bool = False,
                checkpoint: StreamCheckpoint | None = None, log: Callable[[str], None] | None = None,
                spill=None) -> dict:
    """Merge ``model``'s experts in place (REAM) and return the ``ream_metadata.json`` content.

    Saliency (``ream.saliency_source``): ``layerwise`` (the default, REAM's own) measures each layer's saliency
    during the merge on the hidden states the merged earlier layers give it
    (:mod:`mlx_fun.rewrite.ream_saliency`; ``saliency`` must then be ``None``); ``file``: ``saliency`` ((L, E)
    scores, higher = more important; ``selection.metric`` names them in the metadata), or, without it, the REAP
    score (renormalised router weight × ‖y‖) of the similarity tokens. The saliency orders the centroids and
    weights the averages. Centroids: ``keep_map`` ({MoE position: kept experts}) or, when it is ``None``, the
    ``E − selection.n_prune`` most salient experts of each layer (layerwise: chosen as the layer is reached).
    ``ream`` (:class:`~mlx_fun.rewrite.merge_options.Ream`): how experts are merged; ``calibration``: its ``seed``
    draws the token subsets and ``batch_size`` batches the forwards (and the layerwise saliency's means).
    ``samples`` are token-id lists (calibration data). The new config is ``adapter.config`` afterwards.

    ``checkpoint`` (:class:`mlx_fun.observe.checkpoint.StreamCheckpoint`): streamed
    (:func:`mlx_fun.rewrite.merge_stream.run_streamed`; ``log``
    says where it resumes): the model's layers up to the last MoE layer are left empty and ``checkpoint.parts(last)``
    holds them for the writer, equal bit for bit to the in-memory merge's (the same computations run). A family
    whose layers read state other layers hand on is refused in one line. ``spill``: the driver's (hidden states
    carried in files in that directory, removed at the end).
    """
    t_start = time.perf_counter()
    n_prune, metric, seed = selection.n_prune, selection.metric, calibration.seed
    similarity_mode, alignment, max_group_size = ream.similarity_mode, ream.alignment, ream.max_group_size
    max_similarity_tokens, max_alignment_tokens = ream.max_similarity_tokens, ream.max_alignment_tokens
    layerwise = ream.saliency_source == "layerwise"
    moe_layers = adapter.moe_layers()
    L, E = len(moe_layers), adapter.num_experts
    scores = _file_scores(saliency, L, E, layerwise)
    keep_map, choose, n_kept = _centroids(adapter, keep_map, scores, n_prune, layerwise)
    samples = [list(s) for s in samples if len(s)]
    if not samples:
        raise UserError("no calibration tokens: the dataset gave no non-empty samples.")
    if checkpoint is not None:
        from ..observe.collect import check_streamable

        check_streamable(adapter, run="a streamed merge", instead="use prune (for a model larger than memory, "
                         f"its saliency collected with {param('pipeline')} across machines under mlx.launch)")

    # ---- calibration hidden states, carried through the layers by the layered driver
    driver = LayerDriver(model, adapter, samples, batch_size=calibration.batch_size, pad_id=pad_id,
                         token_budget=token_budget, spill=spill)
    selects, n_cap, sim_rows, align_rows = _capture_rows(driver, max_similarity_tokens, max_alignment_tokens, seed)
    n_tokens = driver.n_tokens

    acc = ReamSaliency(E, -(-len(samples) // calibration.batch_size)) if layerwise else None
    tap = ReamCaptureTap(acc)
    centroid_map, group_map, saliency_map = {}, {}, {}
    # every expert on the similarity tokens, a few experts at a time: each chunk's outputs no larger than one
    # forward's hidden state (token budget × hidden), so merging never peaks above the forward it replays
    chunk_elems = engine.token_budget(token_budget) * int(driver.batches[0].h.shape[-1])

    def select(batch) -> bool:
        tap.select = selects[batch.index]
        if acc is not None:  # the layerwise saliency reads every token
            tap.token_batches = batch_of_tokens(batch.rows, batch.valid, calibration.batch_size)
            return True
        return tap.select is not None

    def on_layer(i: int) -> None:
        if i not in moe_layers:
            return
        pos = moe_layers.index(i)
        tap.layer = pos  # 1. capture the block's input / logits / routing of the selected tokens (and saliency)
        if acc is not None:
            acc.reset()
        driver.replay(i, before=select)
        tap.layer, tap.select = None, None
        x, logits, inds, rweights = tap.take()
        sal = acc.scores() if acc is not None else None if scores is None else scores[pos]
        if choose:
            keep_map[pos] = layer_centroids(adapter, sal, n_prune)
        groups, sal = _merge_block(
            adapter, adapter.block(i), keep_map[pos], x, logits, inds, rweights, sal, sim_rows, align_rows,
            similarity_mode, alignment, max_group_size, chunk_elems,
        )  # fmt: skip   2. rewrite; the driver then propagates through the merged layer
        centroid_map[str(i)] = keep_map[pos]
        group_map[str(i)] = {str(c): [int(e) for e in m] for c, m in sorted(groups.items())}
        saliency_map[str(i)] = [float(v) for v in sal]

    maps = {"centroid_map": centroid_map, "group_map": group_map, "saliency": saliency_map}
    with driver, moe_hook.hooked(adapter, [tap]):
        if checkpoint is None:
            driver.run(on_layer, progress=progress, desc="merge")
        else:
            from .merge_stream import run_streamed

            run_streamed(driver, on_layer, checkpoint, maps, progress=progress, log=log or (lambda _line: None))
    layer_seconds = {str(i): driver.seconds[i] for i in moe_layers}
    adapter.config = pruned_config(adapter, adapter.config, n_kept)
    return {
        "method": "ream",
        "original_num_experts": E,
        "merged_num_experts": n_kept,
        "saliency_source": ream.saliency_source,
        "metric": (LAYERWISE_METRIC if layerwise else metric if scores is not None else "reap (calibration tokens)"),
        **maps,
        "similarity_mode": similarity_mode,
        "alignment": alignment,
        "max_group_size": max_group_size,
        "calibration_samples": len(samples),
        "calibration_tokens": n_tokens,
        "similarity_tokens": min(max_similarity_tokens, n_cap),
        "alignment_tokens": min(max_alignment_tokens, n_cap),
        "seed": seed,
        "layer_seconds": layer_seconds,
        "seconds": round(time.perf_counter() - t_start, 3),
    }


def _centroids(adapter: MoEAdapter, keep_map, scores, n_prune, layerwise: bool) -> tuple[dict, bool, int]:
    """``(keep_map, choose, n_kept)``: the centroids of every MoE position (``keep_map`` as given, or the
    ``E − n_prune`` most salient of ``scores``; layerwise, placeholders that every rule of the selection has
    checked, chosen again as each layer is reached: ``choose``) and how many each layer keeps."""
    L, E = len(adapter.moe_layers()), adapter.num_experts
    choose = False
    if keep_map is None:
        if n_prune is None or (scores is None and not layerwise):
            raise ValueError("give keep_map, or n_prune (and, with saliency_source='file', saliency)")
        keep_map = select_centroids(adapter, np.ones((L, E)) if layerwise else scores, n_prune)
        choose = layerwise
    keep_map = {p: sorted(int(e) for e in keep_map.get(p, range(E))) for p in range(L)}
    n_kept = check_keep_map(adapter, keep_map)
    if adapter.groups and n_kept % adapter.groups[0]:
        raise UserError(
            f"this router picks experts in {adapter.groups[0]} groups, so the centroid count ({n_kept}) must be "
            f"divisible by {adapter.groups[0]}; merge the same number of experts in every group."
        )
    return keep_map, choose, n_kept


def _capture_rows(driver: LayerDriver, max_similarity_tokens: int, max_alignment_tokens: int, seed):
    """``(selects, n_captured, similarity rows, alignment rows)``: which tokens of each batch are captured (a random
    subset of ``max(max_similarity_tokens, max_alignment_tokens)``, drawn with ``seed``; None: none of the batch)
    and, in capture order, the rows each measurement reads."""
    rng = np.random.default_rng(seed)
    selects, n_cap = _token_subsets([b.valid for b in driver.batches],
                                    max(max_similarity_tokens, max_alignment_tokens), rng)
    selects = [mx.array(sel.astype(np.int32)) if len(sel) else None for sel in selects]
    order = rng.permutation(n_cap)  # random rank of every captured token (they arrive in batch order)
    sim_rows = mx.array(np.sort(order[:max_similarity_tokens]).astype(np.int32))
    align_rows = mx.array(np.sort(order[:max_alignment_tokens]).astype(np.int32))
    return selects, n_cap, sim_rows, align_rows


def _file_scores(saliency, L: int, E: int, layerwise: bool) -> np.ndarray | None:
    """``saliency`` as checked (L, E) float64 scores (``None`` when not given); refused with a layerwise source."""
    if saliency is None:
        return None
    if layerwise:
        raise UserError(f"a saliency file is read only with {param('saliency_source')} file; the layerwise source "
                        f"measures each layer's saliency during the merge: drop the file or pass "
                        f"{param('saliency_source')} file.")
    scores = np.asarray(saliency, dtype=np.float64)
    if scores.shape != (L, E):
        raise UserError(f"saliency scores have shape {scores.shape} but the model has {L} MoE layers × {E} experts; "
                        "collect them on this model.")
    return scores


def layer_centroids(adapter: MoEAdapter, saliency_row: np.ndarray, n_prune: int) -> list[int]:
    """The ``E − n_prune`` most salient experts of one layer's ``saliency_row`` (:func:`select_centroids`' rules:
    ties to the lower index, group balance of group-limited routers)."""
    return select_centroids(adapter, np.asarray(saliency_row, dtype=np.float64)[None, :], n_prune)[0]


def _merge_block(adapter, block, centroids, x, logits, inds, rweights, scores_row, sim_rows, align_rows,
                 similarity_mode, alignment, max_group_size, chunk_elems) -> tuple[dict[int, list[int]], np.ndarray]:  # fmt: skip
    """Similarity → groups → aligned weighted averages → write; returns the groups and the saliency used
    (``scores_row``, or, when it is ``None``, the REAP of the similarity tokens)."""
    experts = adapter.experts(block)
    E = logits.shape[-1]
    xs, ls = x[sim_rows], logits[sim_rows]
    stats = dense_expert_stats(experts, xs, ls, chunk_elems=chunk_elems)
    mean_out = stats.mean_gated_output if similarity_mode == "gated" else stats.mean_output
    similarity = expert_similarity(mean_out, np.array(ls))
    if scores_row is None:
        sal = routed_saliency(stats.norms, np.array(inds[sim_rows]), np.array(rweights[sim_rows]), E)
    else:
        sal = np.asarray(scores_row, dtype=np.float64)
    groups = group_experts(similarity, sal, centroids, max_group_size)
    x_align = x[align_rows].astype(mx.float32)
    merged: dict[int, dict] = {}
    for c, members in groups.items():
        w = np.clip(sal[members], 0.0, None)
        w = w / w.sum() if w.sum() > 0 else np.full(len(members), 1.0 / len(members))
        use = [(m, float(wt)) for m, wt in zip(members, w) if wt > 0 or m == c]
        if len(use) == 1 and use[0][0] == c and abs(use[0][1] - 1.0) < 1e-12:
            continue  # nothing merged into this centroid: keep its tensors as they are
        merged[c] = merge_group(experts, [m for m, _ in use], [wt for _, wt in use], x_align, alignment)
    write_merged(adapter, block, sorted(centroids), merged)
    return groups, sal
