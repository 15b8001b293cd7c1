#!/usr/bin/env python3
"""REAM parity: the REAM paper's own merger (SamsungSAILMontreal/ream, ``ream/merger.py``) against ``mlx-fun
merge``'s library call on the same model and calibration tokens, beside ``mlx-fun prune`` (REAP) at the same
expert count.

    python -m scripts.parity.ream --reference /work/refs/ream --python /work/venvs/ref45/bin/python
    python -m scripts.parity.ream --reference ... --python ... --domain prose     # prose calibration

Calibration: ``--samples`` full-length sequences of ``--seq-len`` tokens from the prepared corpus' ``--domain``
train split (no padding on either side: the reference counts padded positions in its statistics). The reference
runs as its ``merge.py`` runs it (``Merger`` with its defaults: REAP saliency, REAM grouping with C =
``--group-size``, ``logits+weights`` merging, sequential, gate outputs, gated similarity), reading the tokens from
the batch file it expects (``data/<name>_b<N>_seq<L>_qwen3_seed<seed>.pt`` under the work directory); its
``pseudo_group`` is wrapped to record each layer's saliency, similarity and groups. Printed:

1. per layer, the centroids and groups of both, how alike the two similarity matrices rank expert pairs, and how
   close our layerwise saliency (``merge``'s default, ``--saliency-source layerwise``) is to the reference's;
2. the merged weights of ours given the reference's groups, centroids and saliency (``group_experts`` made to
   return the reference's groups) against the reference's merged weights: max abs difference per layer;
3. held-out perplexity (code and prose test splits, mlx-fun's evaluator for every model, the reference's merged
   model loaded back with mlx_lm) of: the original, REAP pruning, our merge (default, layerwise saliency), our
   merge ranked and weighted by collect's REAP (``--saliency-source file``), the reference's merge, ours on the
   reference's groups.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from scripts.parity.common import (add_common_args, exported, read_tokens, reference_path, run_reference,
                                   sides, table, write_tokens)

DOMAINS = ("code", "prose")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, work="/tmp/parity-ream")
    p.add_argument("--corpus", default="/tmp/parity-corpus", help="prepared corpus (made here if missing)")
    p.add_argument("--domain", choices=DOMAINS, default="code", help="calibration domain (train split)")
    p.add_argument("--samples", type=int, default=64, help="calibration sequences")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration sequence")
    p.add_argument("--eval-samples", type=int, default=48, help="held-out test samples per domain")
    p.add_argument("--fraction", type=float, default=0.25, help="fraction of each layer's experts removed")
    p.add_argument("--group-size", type=int, default=16, help="REAM's C (both sides)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--reuse", action="store_true",
                   help="reuse the reference's merge in --work when it was made from the same inputs")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- reference side
def reference_side(args) -> None:
    """Run the reference Merger on ``work/tokens.json``; write ``work/ref/merged`` and ``work/ref/groups.json``."""
    import torch

    work = Path(args.work).resolve()
    job = json.loads((work / "job.json").read_text())
    tokens = torch.tensor(read_tokens(work / "tokens.json"))
    n, seq = tokens.shape
    ref = work / "ref"
    (ref / "data").mkdir(parents=True, exist_ok=True)
    torch.save({"input_ids": tokens, "attention_mask": torch.ones_like(tokens)},
               ref / "data" / f"parity_b{n}_seq{seq}_qwen3_seed{args.seed}.pt")
    reference_path(args.reference)
    os.chdir(ref)  # the Merger reads data/<batch file> relative to the working directory
    import ream.merger as merger_mod
    from ream.ream import expert_similarity
    from ream.utils import dist2sim, normalize_rows
    from transformers import AutoModelForCausalLM

    record = []
    pseudo_group = merger_mod.pseudo_group

    def recording(saliency, expert_logits, k, gate_logits=None, group_size=16):
        labels, centroids = pseudo_group(saliency, expert_logits=expert_logits, k=k, gate_logits=gate_logits,
                                         group_size=group_size)
        # the similarity pseudo_group ranks by, from the reference's own functions (its lines 46-64)
        x = normalize_rows(gate_logits.float().transpose(0, 1))
        sim_gate = dist2sim(torch.cdist(x, x).numpy(), remove_self_loops=False)
        e = expert_logits.shape[0]
        sim = np.ones((e, e))
        for i in range(e):
            for j in range(i + 1, e):
                sim[i, j] = sim[j, i] = (expert_similarity(logits1=expert_logits[i], logits2=expert_logits[j])
                                         + sim_gate[i, j]) / 2
        sal = saliency.cpu().numpy() if hasattr(saliency, "cpu") else np.asarray(saliency)
        groups = {}
        for c in centroids:  # centroid first, as the merger orders a group
            members = [int(m) for m in np.where(labels == labels[c])[0] if m != c]
            groups[str(int(c))] = [int(c)] + members
        record.append({"saliency": sal.astype(float).tolist(), "centroids": sorted(int(c) for c in centroids),
                       "groups": groups, "similarity": sim.tolist()})
        return labels, centroids

    merger_mod.pseudo_group = recording
    model = AutoModelForCausalLM.from_pretrained(work / "transformers", dtype=torch.float32).eval()
    np.random.seed(args.seed)  # the merger samples activation rows with np.random, seeded only for mixed datasets
    torch.manual_seed(args.seed)
    merger = merger_mod.Merger(model, merge_size=job["kept"], grouping="ream", merging="logits+weights",
                               saliency="reap", dataset="parity", mix_ratio="1.0", tokenizer_name="qwen3",
                               batch_size=args.batch_size, group_size=args.group_size, sequential=True,
                               use_gate_output=True, gated_sim=True, calibration_data_size=n,
                               calibration_data_seq_len=seq, seed=args.seed, verbose=False)
    merged = merger.fit()
    out = ref / "merged"
    merged.save_pretrained(out, safe_serialization=True)
    for f in (work / "transformers").iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy2(f, out / f.name)
    (ref / "groups.json").write_text(json.dumps(record))


# --------------------------------------------------------------------------------------------------- main side
def calibration_tokens(path: Path, tokenizer, n: int, seq: int, seed: int) -> list[list[int]]:
    """The first ``n`` samples of ``path`` (mlx-fun's loader, shuffled by ``seed``) that fill ``seq`` tokens."""
    from mlx_fun.datasets.samples import load_samples

    full = [list(s) for s in load_samples(str(path), tokenizer, max_samples=10**6, max_tokens=seq, seed=seed)
            if len(s) == seq]
    if len(full) < n:
        sys.exit(f"Error: {path} has only {len(full)} samples of {seq} tokens; pass a smaller --samples or --seq-len.")
    return full[:n]


class Recorded:
    """Wraps :func:`mlx_fun.rewrite.merge.group_experts`: records each layer's similarity, saliency and groups,
    and, when ``forced`` holds a layer's groups, returns those instead (ours merging the reference's groups)."""

    def __init__(self, forced: list[dict] | None = None):
        from mlx_fun.rewrite import merge

        self.merge, self.original, self.forced, self.layers = merge, merge.group_experts, forced, []

    def __enter__(self):
        def group_experts(similarity, saliency, centroids, max_group_size):
            groups = self.original(similarity, saliency, centroids, max_group_size)
            if self.forced is not None:
                groups = {int(c): list(m) for c, m in self.forced[len(self.layers)]["groups"].items()}
            self.layers.append({"similarity": np.asarray(similarity), "saliency": np.asarray(saliency),
                                "groups": {int(c): [int(e) for e in m] for c, m in groups.items()}})
            return groups

        self.merge.group_experts = group_experts
        return self

    def __exit__(self, *exc):
        self.merge.group_experts = self.original


def main_side(args) -> int:
    from mlx_fun.runtime.blas import maybe_reexec

    maybe_reexec()
    from mlx_fun.adapters import get_adapter
    from mlx_fun.datasets import corpus
    from mlx_fun.datasets.calibration import Calibration
    from mlx_fun.datasets.samples import load_samples, pad_id
    from mlx_fun.experts.selection import Selection, select_experts
    from mlx_fun.model.io import load_model
    from mlx_fun.observe.collect import collect
    from mlx_fun.observe.evaluate import ReferenceCache, evaluate
    from mlx_fun.rewrite.merge import merge_model
    from mlx_fun.rewrite.merge_options import Ream
    from mlx_fun.rewrite.prune import prune_model

    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    corpus.ensure_prepared(args.corpus, sources=corpus.ALWAYS)
    exported(args.model, work)
    base, tokenizer, config = load_model(args.model)
    adapter = get_adapter(base, config)
    E, L = adapter.num_experts, len(adapter.moe_layers())
    n_prune = round(E * args.fraction)
    kept, pad = E - n_prune, pad_id(tokenizer)
    calib = calibration_tokens(corpus.domain_file(args.corpus, args.domain, "train"), tokenizer, args.samples,
                               args.seq_len, args.seed)
    test = {d: [list(s) for s in load_samples(str(corpus.domain_file(args.corpus, d, "test")), tokenizer,
                                              max_samples=args.eval_samples, max_tokens=args.seq_len, seed=0)]
            for d in DOMAINS}
    write_tokens(work / "tokens.json", calib)
    (work / "job.json").write_text(json.dumps({"kept": kept}))
    print(f"REAM parity on {args.model}: {L} MoE layers x {E} experts -> {kept}; calibration {len(calib)} x "
          f"{args.seq_len} tokens of {args.domain}/train (seed {args.seed}); held-out "
          + ", ".join(f"{d}/test {sum(map(len, s)):,} tok" for d, s in test.items()), flush=True)
    stamp = json.dumps({"tokens": hashlib.sha256((work / "tokens.json").read_bytes()).hexdigest(), "kept": kept,
                        "group_size": args.group_size, "batch_size": args.batch_size, "seed": args.seed})
    done = work / "ref" / "inputs.json"
    if not (args.reuse and done.is_file() and done.read_text() == stamp):
        run_reference("ream", args, ["--seed", str(args.seed), "--group-size", str(args.group_size),
                                     "--batch-size", str(args.batch_size)])
        done.write_text(stamp)
    ref_layers = json.loads((work / "ref" / "groups.json").read_text())

    saliency = collect(base, adapter, calib, batch_size=args.batch_size, pad_id=pad)  # mlx-fun collect's pass
    ref_cache = ReferenceCache.build(base, test, batch_size=args.batch_size, pad_id=pad)
    ppl = {}

    def score(name, model):
        res = evaluate(model, test, reference=ref_cache, batch_size=args.batch_size, pad_id=pad)
        ppl[name] = {d: (res[d]["ppl"], res[d]["kl"]) for d in DOMAINS}

    def fresh():
        model, _, cfg = load_model(args.model)
        return model, get_adapter(model, cfg)

    score("original", base)
    model, ad = fresh()
    keep = select_experts(saliency.scores("reap"), n_prune, top_k=ad.top_k, groups=ad.groups,
                          moe_layer_indices=ad.moe_layers())
    prune_model(ad, keep)
    score("prune (REAP)", model)
    model, ad = fresh()
    how = dict(selection=Selection(n_prune=n_prune), pad_id=pad,
               calibration=Calibration(seed=args.seed, batch_size=args.batch_size))
    with Recorded() as ours:
        merge_model(model, ad, calib, ream=Ream(max_group_size=args.group_size), **how)
    score("merge (mlx-fun)", model)
    model, ad = fresh()
    merge_model(model, ad, calib, saliency=saliency.scores("reap"),
                ream=Ream(max_group_size=args.group_size, saliency_source="file"), **how)
    score("merge (mlx-fun, --saliency-source file)", model)
    ref_model, _, _ = load_model(work / "ref" / "merged")
    score("merge (reference)", ref_model)
    model, ad = fresh()
    ref_sal = np.array([r["saliency"] for r in ref_layers])
    with Recorded(forced=ref_layers):
        merge_model(model, ad, calib, keep_map={p: r["centroids"] for p, r in enumerate(ref_layers)},
                    saliency=ref_sal, ream=Ream(max_group_size=args.group_size, saliency_source="file"),
                    calibration=Calibration(seed=args.seed, batch_size=args.batch_size), pad_id=pad)
    score("merge (mlx-fun, reference groups)", model)
    compare_groups(ours.layers, ref_layers)
    compare_weights(model, ref_model, adapter)
    return report(args, ppl)


def compare_groups(ours: list[dict], theirs: list[dict]) -> None:
    from scipy.stats import spearmanr

    print("\n1. groups per MoE layer (mlx-fun | reference)")
    rows = []
    for pos, (o, r) in enumerate(zip(ours, theirs)):
        S_o, S_r = o["similarity"], np.array(r["similarity"])
        iu = np.triu_indices_from(S_o, k=1)
        rho = spearmanr(S_o[iu], S_r[iu]).statistic
        cent_o, cent_r = sorted(o["groups"]), r["centroids"]
        g_o = {c: sorted(m) for c, m in o["groups"].items()}
        g_r = {int(c): sorted(m) for c, m in r["groups"].items()}
        same_groups = sum(g_o.get(c) == m for c, m in g_r.items())
        merged_o = {c: m for c, m in g_o.items() if len(m) > 1}
        merged_r = {c: m for c, m in g_r.items() if len(m) > 1}
        sal_o, sal_r = np.asarray(o["saliency"]), np.array(r["saliency"])
        sal_rho = spearmanr(sal_o, sal_r).statistic
        sal_rel = np.abs(sal_o - sal_r).max() / np.abs(sal_r).max()
        rows.append([str(pos), f"{len(set(cent_o) & set(cent_r))}/{len(cent_r)}", f"{same_groups}/{len(g_r)}",
                     f"{rho:.3f}", f"{max(S_o[iu]):.3f}/{min(S_o[iu]):.3f}", f"{max(S_r[iu]):.3f}/{min(S_r[iu]):.3f}",
                     f"{sal_rho:.3f}", f"{sal_rel:.2e}", f"{sal_o.max():.4g}/{sal_r.max():.4g}",
                     str(merged_o), str(merged_r)])
    table(["layer", "same centroids", "same groups", "similarity rank corr", "ours max/min", "ref max/min",
           "saliency rank corr", "saliency max diff / ref max", "saliency max ours/ref", "mlx-fun groups of >1",
           "reference groups of >1"], rows)


def compare_weights(ours_model, ref_model, adapter) -> None:
    """Max abs difference of the merged experts' weights, ours (reference groups) vs the reference's, per layer."""
    from mlx.utils import tree_flatten

    a = dict(tree_flatten(ours_model.parameters()))
    b = dict(tree_flatten(ref_model.parameters()))
    print("\n2. merged weights, mlx-fun on the reference's groups vs the reference (max abs diff; scale: max abs)")
    rows = []
    for i in adapter.moe_layers():
        row = [str(i)]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            key = f"model.layers.{i}.mlp.switch_mlp.{proj}.weight"
            x, y = np.array(a[key]), np.array(b[key])
            row.append(f"{np.abs(x - y).max():.3g} ({np.abs(y).max():.3g})")
        key = f"model.layers.{i}.mlp.gate.weight"
        row.append(f"{np.abs(np.array(a[key]) - np.array(b[key])).max():.3g}")
        rows.append(row)
    table(["layer", "gate_proj", "up_proj", "down_proj", "router"], rows)


def report(args, ppl: dict) -> int:
    print(f"\n3. held-out perplexity (x the original), calibration {args.domain}, {args.fraction:.0%} of experts removed")
    base = ppl["original"]
    rows = [[name] + [f"{v[d][0]:.3f} (x{v[d][0] / base[d][0]:.3f}) KL {v[d][1]:.3f}" for d in DOMAINS]
            for name, v in ppl.items()]
    table(["model", *(f"{d}/test ppl" for d in DOMAINS)], rows)
    prune = ppl["prune (REAP)"]
    for name in ("merge (mlx-fun)", "merge (mlx-fun, --saliency-source file)", "merge (reference)"):
        beats = [d for d in DOMAINS if ppl[name][d][0] < prune[d][0]]
        print(f"verdict: {name} {'beats' if beats else 'does not beat'} REAP pruning"
              + (f" on {', '.join(beats)}" if beats else "") + " at the same expert count")
    return 0


def main(argv=None) -> int:
    return sides(parse_args(argv), reference=reference_side, ours=main_side)


if __name__ == "__main__":
    sys.exit(main())
