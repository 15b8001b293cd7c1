#!/usr/bin/env python3
"""REAP parity: the REAP paper's own observer (CerebrasResearch/reap, ``src/reap/observer.py``) against
``mlx-fun collect`` on the same model and the same token ids.

    python -m scripts.parity.reap --reference /work/refs/reap --python /work/venvs/ref45/bin/python
    python -m scripts.parity.reap --reference ... --python ... --device cuda     # the reference on a GPU

The model is exported to transformers' layout (scripts/tools/export_transformers.py); the samples are drawn and
tokenized once by mlx-fun's own calibration loader (``--dataset``, ``--max-samples``, ``--max-tokens``, ``--seed``),
``mlx-fun collect``'s job runs on them, and the reference observer (hooked on transformers' ``Qwen3MoeSparseMoeBlock``,
configured as the reference's ``main._setup_observer`` and ``experiments/pruning-cli.sh`` configure it: router weights
renormalized over the top-k as qwen3_moe's ``norm_topk_prob`` does, pruning metrics only, one sample per batch) on the
same token ids. Printed per metric: the largest relative difference over all layers × experts, and how many layers
rank their experts in the same order; then both throughputs (tokens / second of the calibration pass, model load
excluded). ``reap``, ``ean`` (mean) are per routed token; ``freq``, ``weighted_freq``, ``ean_sum`` are sums.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from scripts.parity.common import (add_common_args, exported, max_rel, rankings_equal, read_tokens,
                                   reference_path, run_reference, sides, table, write_tokens)

#: ours (SaliencyAccumulator) → the reference observer's state key, per metric
METRICS = {"freq": "expert_frequency", "weighted_freq": "weighted_expert_frequency_sum", "reap": "reap",
           "ean": "ean_mean", "ean_sum": "ean_sum"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, work="/tmp/parity-reap")
    p.add_argument("--dataset", default=None, help="calibration JSONL (default: the prepared corpus' code/train)")
    p.add_argument("--corpus", default="/tmp/parity-corpus", help="where the corpus is prepared if --dataset is not given")
    p.add_argument("--max-samples", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=1e-5,
                   help="largest relative difference that passes (experts whose counts agree)")
    p.add_argument("--max-flips", type=float, default=1e-4,
                   help="largest share of routing choices that may differ (near-ties under float rounding)")
    p.add_argument("--reuse", action="store_true",
                   help="reuse the reference's numbers in --work when they were made on the same tokens")
    return p.parse_args(argv)


def tokens_hash(work: Path) -> str:
    import hashlib

    return hashlib.sha256((work / "tokens.json").read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------- reference side
def reference_side(args) -> None:
    """Run the reference observer on ``work/tokens.json``; write ``work/reference.npz``."""
    import torch
    from transformers import AutoModelForCausalLM

    reference_path(args.reference, "src")
    from reap.observer import OBSERVER_CONFIG_REGISTRY, MoETransformerObserver

    work = Path(args.work)
    model = AutoModelForCausalLM.from_pretrained(work / "transformers", dtype=torch.float32).to(args.device).eval()
    config = OBSERVER_CONFIG_REGISTRY[model.__class__.__name__](  # as reap.main._setup_observer
        distance_measure="cosine", renormalize_router_weights=bool(model.config.norm_topk_prob),
        record_pruning_metrics_only=True)
    observer = MoETransformerObserver(model=model, hook_config=config)
    samples = read_tokens(work / "tokens.json")
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    with torch.no_grad():  # one warm-up forward (kernels, allocator), not counted
        model(input_ids=torch.tensor([samples[0][:8]], device=args.device))
        observer.reset()
        sync()
        start = time.perf_counter()
        for s in samples:
            model(input_ids=torch.tensor([s], device=args.device))
        sync()
        seconds = time.perf_counter() - start
    state = observer.report_state()
    layers = sorted(state)
    out = {key: np.stack([state[i][key].double().numpy() for i in layers]) for key in METRICS.values()}
    out["total_tokens"] = np.array([int(state[i]["total_tokens"]) for i in layers])
    np.savez(work / "reference.npz", seconds=seconds, tokens=sum(map(len, samples)), device=args.device,
             tokens_sha256=tokens_hash(work), **out)
    print(f"reference observer: {len(layers)} layers, {sum(map(len, samples)):,} tokens in {seconds:.2f} s "
          f"on {args.device}", flush=True)


# --------------------------------------------------------------------------------------------------- main side
def main_side(args) -> int:
    from mlx_fun.core import env
    from mlx_fun.runtime.blas import maybe_reexec

    env.keep_float32()  # as the mlx-fun launcher does, before mlx is imported: float32 stays float32 on a GPU
    maybe_reexec()
    from mlx_fun import jobs
    from mlx_fun.datasets import corpus
    from mlx_fun.datasets.calibration import Calibration
    from mlx_fun.model.io import load_model
    from mlx_fun.observe.checkpoint import samples_hash

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    dataset = args.dataset
    if dataset is None:
        corpus.ensure_prepared(args.corpus, sources=corpus.ALWAYS)
        dataset = str(corpus.domain_file(args.corpus, "code", "train"))
    exported(args.model, work)
    cal = Calibration(max_samples=args.max_samples, max_tokens=args.max_tokens, seed=args.seed, batch_size=1)
    _, tokenizer, _ = load_model(args.model)
    samples = [list(s) for s in cal.load(dataset, tokenizer)]
    write_tokens(work / "tokens.json", samples)
    ours = jobs.collect.run(model=args.model, dataset=dataset, output=work / "ours.npz", force=True, calibration=cal)
    if ours.accumulator.provenance["source_samples_sha256"] != samples_hash(samples):
        sys.exit("Error: collect drew other samples than the ones given to the reference; this is a bug here.")
    done = work / "reference.npz"
    if not (args.reuse and done.is_file() and str(np.load(done)["tokens_sha256"]) == tokens_hash(work)):
        run_reference("reap", args, [])
    ref = np.load(done)
    return compare(args, dataset, samples, ours, ref)


def compare(args, dataset, samples, ours, ref) -> int:
    acc = ours.accumulator
    tokens = sum(map(len, samples))
    print(f"\nREAP parity on {args.model} ({acc.num_layers} MoE layers x {acc.num_experts} experts, top-{acc.top_k}); "
          f"{len(samples)} samples of {dataset}, {tokens:,} tokens (seed {args.seed})")
    ok = int(acc.total_tokens) == tokens and all(int(t) == tokens for t in ref["total_tokens"])
    print(f"tokens counted: mlx-fun {acc.total_tokens:,}  reference {', '.join(f'{int(t):,}' for t in ref['total_tokens'])}")
    flips_per_layer = (np.abs(acc.freq - ref["expert_frequency"]).sum(axis=1) // 2).astype(int)
    flips, routed = int(flips_per_layer.sum()), int(acc.freq.sum())
    first = int(np.argmax(flips_per_layer > 0)) if flips else acc.num_layers  # layers before it saw the same inputs
    print(f"routing: {flips} of {routed:,} (token, expert) choices differ, per layer {flips_per_layer.tolist()} (a "
          f"top-k near-tie decided the other way by float rounding; that token's hidden state differs from there on)")
    ok &= flips <= args.max_flips * routed
    ours_metric = {"freq": acc.freq, "weighted_freq": acc.weighted_freq_sum, "reap": acc.scores("reap"),
                   "ean": acc.scores("ean"), "ean_sum": acc.ean_sum}
    rows = []
    for name, key in METRICS.items():
        per_layer = [max_rel(o, r) for o, r in zip(ours_metric[name], ref[key])]
        same, layers = rankings_equal(ours_metric[name], ref[key])
        # frequencies tie, so their order is not compared; sums are held to the tolerance before the first flip
        ok &= name == "freq" or (all(r <= args.tolerance for r in per_layer[:first]) and same == layers)
        rows.append([name, *(f"{r:.2e}" for r in per_layer), f"{same}/{layers}"])
    table(["metric", *(f"layer {i} max rel diff" for i in range(acc.num_layers)), "layers ranked identically"], rows)
    print("\nlayer 0, first 6 experts (mlx-fun | reference):")
    for name, key in METRICS.items():
        print(f"  {name:>13}: " + " ".join(f"{v:.6g}" for v in ours_metric[name][0, :6]) + "  |  "
              + " ".join(f"{v:.6g}" for v in ref[key][0, :6]))
    ref_tps = tokens / float(ref["seconds"])
    print(f"\nthroughput: mlx-fun collect {ours.tokens / ours.seconds:,.0f} tok/s (default device)  |  reference "
          f"observer {ref_tps:,.0f} tok/s ({ref['device']})")
    print(f"verdict: PASS: {flips} of {routed:,} routing choices differ; REAP / EAN / weighted frequency within "
          f"{args.tolerance:g} relative up to the first differing choice (layer {first}); every layer's ranking "
          f"identical" if ok else
          "verdict: FAIL: see the rows above")
    return 0 if ok else 1


def main(argv=None) -> int:
    return sides(parse_args(argv), reference=reference_side, ours=main_side)


if __name__ == "__main__":
    sys.exit(main())
