#!/usr/bin/env python3
"""REAP-paper-style quality table on the bundled trained MoE, in one run.

Rows: the original; pruning by REAP, EAN, freq, weighted_freq and random (mean of 3 seeds) at 25% and 50% of
each layer's experts; REAM merging (``mlx-fun merge``'s library call) at the same counts. Every saliency-based
row is calibrated once on the code domain and once on the prose domain (train splits); every model is scored
on the held-out test split of both domains: perplexity, and KL(original ‖ model) per token.

    python -m scripts.benchmarks.bench_quality                        # writes docs/benchmarks/quality.md
    python -m scripts.benchmarks.bench_quality --max-eval-samples 16  # quicker, noisier

Everything runs in-process on the current MLX backend; the corpus is prepared under --data if missing.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from mlx_fun.runtime.blas import blas_status, maybe_reexec

maybe_reexec()  # Linux CPU: a fast BLAS preloaded, as the `mlx-fun` launcher does (before mlx is imported)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlx_fun.datasets import corpus  # noqa: E402
from mlx_fun.adapters import get_adapter  # noqa: E402
from mlx_fun.dispatch import experts as dispatch  # noqa: E402
from mlx_fun.observe.collect import collect  # noqa: E402
from mlx_fun.datasets.samples import load_samples, pad_id  # noqa: E402
from mlx_fun.observe.evaluate import ReferenceCache, evaluate  # noqa: E402
from mlx_fun.model.io import bundled_model_dir, load_model  # noqa: E402
from mlx_fun.core.writer import write_json, write_text  # noqa: E402
from mlx_fun.rewrite.merge import merge_model  # noqa: E402
from mlx_fun.rewrite.merge_options import Ream  # noqa: E402
from mlx_fun.experts.selection import Selection  # noqa: E402
from mlx_fun.datasets.calibration import Calibration  # noqa: E402
from mlx_fun.rewrite.prune import prune_model  # noqa: E402
from mlx_fun.experts.selection import select_experts  # noqa: E402

METRICS = ("reap", "ean", "freq", "weighted_freq")
DOMAINS = ("code", "prose")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Model directory (default: the bundled data/tiny-moe)")
    p.add_argument("--data", default="data/corpus", help="Corpus directory (prepared here if missing)")
    p.add_argument("--fractions", default="0.25,0.5", help="Fractions of experts per layer to remove")
    p.add_argument("--calib-samples", type=int, default=128, help="Calibration samples per domain")
    p.add_argument("--max-eval-samples", type=int, default=48, help="Test samples per domain")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--random-seeds", type=int, default=5)
    p.add_argument("--no-merge", action="store_true", help="Skip the REAM rows")
    p.add_argument("--merge-group-sizes", default="16,4",
                   help="REAM --max-group-size values to run (16 is the default of `mlx-fun merge`)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--output", default="docs/benchmarks/quality.md")
    p.add_argument("--json", default=None, help="Also write the raw numbers as JSON")
    p.add_argument("--quantize-output", default="docs/benchmarks/quantize.md",
                   help="Where the quantization rows go (uniform mlx-lm recipes vs `mlx-fun quantize`)")
    p.add_argument("--only-quantize", action="store_true", help="Only the original and the quantization rows")
    p.add_argument("--no-quantize", action="store_true", help="Without the quantization rows")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    model_dir = Path(args.model) if args.model else bundled_model_dir()
    corpus.ensure_prepared(args.data, sources=corpus.ALWAYS)
    t_start = time.perf_counter()
    base, tokenizer, config = load_model(model_dir)
    adapter = get_adapter(base, config)
    dispatch.apply(base, "auto")  # runtime expert dispatch (same numbers within float tolerance, faster)
    E, top_k, L = adapter.num_experts, adapter.top_k, len(adapter.moe_layers())
    pad = pad_id(tokenizer)

    def samples(domain, split, n):
        return [list(s) for s in load_samples(str(corpus.domain_file(args.data, domain, split)), tokenizer,
                                              max_samples=n, max_tokens=args.max_tokens, seed=0)]

    calib = {d: samples(d, "train", args.calib_samples) for d in DOMAINS}
    test = {d: samples(d, "test", args.max_eval_samples) for d in DOMAINS}
    print(blas_status(), flush=True)
    print(f"{config['model_type']}: {L} MoE layers × {E} experts (top-{top_k}); calibration "
          + ", ".join(f"{d} {sum(map(len, s)):,} tok" for d, s in calib.items()) + "; test "
          + ", ".join(f"{d} {sum(map(len, s)):,} tok" for d, s in test.items()), flush=True)

    saliency = {}
    for d in DOMAINS:
        t0 = time.perf_counter()
        saliency[d] = collect(base, adapter, calib[d], batch_size=args.batch_size, pad_id=pad)
        print(f"collected {d} saliency in {time.perf_counter() - t0:.1f} s", flush=True)
    ref = ReferenceCache.build(base, test, batch_size=args.batch_size, pad_id=pad)
    rows = []

    def score(model, label: dict):
        t0 = time.perf_counter()
        res = evaluate(model, test, reference=ref, batch_size=args.batch_size, pad_id=pad)
        row = {**label, **{f"{d}_ppl": res[d]["ppl"] for d in DOMAINS}, **{f"{d}_kl": res[d]["kl"] for d in DOMAINS},
               **{f"{d}_top1": res[d]["top1_agreement"] for d in DOMAINS}}
        rows.append(row)
        print(f"{label['method']:>14} {label['fraction']:>5} calib={label['calibration']:<6} "
              + "  ".join(f"{d} ppl {row[f'{d}_ppl']:7.2f} KL {row[f'{d}_kl']:.3f}" for d in DOMAINS)
              + f"   ({time.perf_counter() - t0:.1f} s)", flush=True)
        return row

    def fresh():
        model, _, cfg = load_model(model_dir)
        return model, get_adapter(model, cfg)

    def ready(model):
        dispatch.apply(model, "auto")  # after pruning/merging: the table entry follows the new expert count
        return model

    score(base, {"method": "original", "fraction": 0.0, "calibration": "-", "experts": E})
    if not args.no_quantize:
        quantize_rows(args, model_dir, saliency["code"], score, ready)
    if args.only_quantize:
        return
    for fraction in (float(f) for f in args.fractions.split(",")):
        n_prune = round(E * fraction)
        kept = E - n_prune
        for d in DOMAINS:
            for metric in METRICS:
                model, ad = fresh()
                keep = select_experts(saliency[d].scores(metric), n_prune, top_k=top_k, groups=ad.groups,
                                      moe_layer_indices=ad.moe_layers())
                prune_model(ad, keep)
                score(ready(model), {"method": metric, "fraction": fraction, "calibration": d, "experts": kept,
                              "routed_kept": routed_kept(saliency[d], keep)})
            for size in ([] if args.no_merge else [int(c) for c in args.merge_group_sizes.split(",")]):
                model, ad = fresh()
                t0 = time.perf_counter()
                merge_model(model, ad, calib[d],  # merge's default: REAM's layerwise saliency (issue 45)
                            selection=Selection(n_prune=n_prune), ream=Ream(max_group_size=size),
                            calibration=Calibration(seed=0), pad_id=pad)
                print(f"  merged in {time.perf_counter() - t0:.1f} s", flush=True)
                name = "ream-merge" if size == 16 else f"ream-merge C={size}"
                score(ready(model), {"method": name, "fraction": fraction, "calibration": d, "experts": kept})
        seeds = []
        for seed in range(args.random_seeds):
            model, ad = fresh()
            scores = np.random.default_rng(seed).random((L, E))
            keep = select_experts(scores, n_prune, top_k=top_k, groups=ad.groups, moe_layer_indices=ad.moe_layers())
            prune_model(ad, keep)
            seeds.append(score(ready(model), {"method": f"random-s{seed}", "fraction": fraction, "calibration": "-",
                                       "experts": kept, "routed_kept": routed_kept(saliency["code"], keep)}))
        mean = {k: float(np.mean([s[k] for s in seeds])) for k in seeds[0]
                if k.endswith(("_ppl", "_kl", "_top1", "_kept"))}
        rows.append({"method": f"random (mean of {len(seeds)})", "fraction": fraction, "calibration": "-",
                     "experts": kept, **mean})
    elapsed = time.perf_counter() - t_start
    write_report(args, rows, config, model_dir, elapsed, calib, test, saliency)
    if args.json:
        write_json(args.json, {"rows": rows, "elapsed_s": elapsed}, force=True)  # a report page this script regenerates


RECIPES = [  # label, fields of jobs.quantize.run's QuantRecipe ("bits": mlx-lm's own uniform convert at these bits)
    ("uniform 4-bit (mlx_lm.convert)", {"bits": 4}),
    ("uniform 3-bit (mlx_lm.convert)", {"bits": 3}),
    ("experts 3 / dense 4 / router float", {"expert_bits": 3, "dense_bits": 4}),
    ("experts 3 / dense 6 / router float", {"expert_bits": 3, "dense_bits": 6}),
    ("experts 2 / dense 4 / router float", {"expert_bits": 2, "dense_bits": 4}),
    ("experts nvfp4 / dense 4 / router float", {"expert_mode": "nvfp4", "expert_bits": None, "dense_bits": 4}),
    ("experts 4, 2 coldest layers 2 / dense 4", {"expert_bits": 4, "dense_bits": 4, "cold_layers": 2,
                                                 "cold_bits": 2}),
]


def quantize_rows(args, model_dir, saliency, score, ready):
    """Uniform mlx-lm recipes against `mlx-fun quantize` recipes: held-out perplexity, KL vs the float original,
    size on disk; written to --quantize-output."""
    import tempfile

    from mlx_lm import convert

    from mlx_fun import jobs
    from mlx_fun.output.model_dir import dir_size
    from mlx_fun.rewrite.quantize import QuantRecipe

    tmp = Path(tempfile.mkdtemp(prefix="bench_quality_q."))
    sal = saliency.save(tmp / "code.npz")
    rows = []
    for label, kw in RECIPES:
        out = tmp / f"q{len(rows)}"
        if "bits" in kw:
            convert(hf_path=str(model_dir), mlx_path=str(out), quantize=True, q_bits=kw["bits"], q_group_size=64)
        else:
            extra = {"saliency": sal} if "cold_layers" in kw else {}
            jobs.quantize.run(model=model_dir, output=out, recipe=QuantRecipe(**kw), **extra)
        model, _, _ = load_model(out)
        row = score(ready(model), {"method": label, "fraction": 0.0, "calibration": "code" if "cold_layers" in kw
                                   else "-", "experts": None})
        rows.append({**row, "mib": dir_size(out) / 2**20})
    base = dir_size(model_dir) / 2**20
    lines = ["# Quantization recipes on the bundled model", "",
             f"`python -m scripts.benchmarks.bench_quality --only-quantize` ({_device()}): {Path(model_dir).name} "
             f"(float32, {base:.1f} MiB) quantized by mlx-lm's uniform `convert` (group size 64; its router is "
             "quantized too) and by `mlx-fun quantize` recipes (affine group size 64 unless named; routers kept in "
             "float). Held-out test split of each domain: perplexity, and KL(float original ‖ quantized) per token. "
             f"{_down_note(model_dir)} The cold-layer row gives the two MoE layers with the smallest summed REAP "
             "(code calibration) 2-bit experts.", "",
             "| recipe | size MiB | code ppl | code KL | prose ppl | prose KL |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['mib']:.2f} | {r['code_ppl']:.2f} | {r['code_kl']:.4f} | "
                     f"{r['prose_ppl']:.2f} | {r['prose_kl']:.4f} |")
    write_text(args.quantize_output, "\n".join(lines) + "\n", force=True)  # a report page this script regenerates
    print(f"wrote {args.quantize_output}", flush=True)


def routed_kept(acc, keep) -> float:
    """Share of the calibration tokens' expert assignments that went to experts the selection keeps."""
    freq = acc.scores("freq")
    return float(sum(freq[pos, list(kept)].sum() for pos, kept in keep.items()) / freq.sum())


def spearman_reap_freq(acc) -> float:
    """Mean over layers of the rank correlation between the REAP and freq scores."""
    from scipy.stats import spearmanr

    reap, freq = acc.scores("reap"), acc.scores("freq")
    return float(np.mean([spearmanr(r, f).statistic for r, f in zip(reap, freq)]))


def interpretation(rows) -> list[str]:
    """Plain-language reading of the table, with its own numbers filled in."""
    def get(method, fraction, calib):
        return next(r for r in rows if r["method"] == method and r["fraction"] == fraction
                    and r["calibration"] == calib)

    top = max(r["fraction"] for r in rows)
    reap, freq, wf = get("reap", top, "code"), get("freq", top, "code"), get("weighted_freq", top, "code")
    rnd = next(r for r in rows if r["method"].startswith("random (") and r["fraction"] == top)
    out = []
    beats_random = all(get("reap", r["fraction"], d)[f"{d}_ppl"] < r[f"{d}_ppl"]
                       for r in rows if r["method"].startswith("random (") for d in DOMAINS)
    beats_freq = reap["code_ppl"] < freq["code_ppl"]
    out.append(
        f"- At {top:.0%} with code calibration, REAP's code perplexity is {reap['code_ppl']:.2f}: "
        f"{'below' if reap['code_ppl'] < rnd['code_ppl'] else 'not below'} random's {rnd['code_ppl']:.2f} and "
        f"{'below' if beats_freq else 'above'} frequency's {freq['code_ppl']:.2f} (weighted_freq "
        f"{wf['code_ppl']:.2f}). REAP beats random in {'every' if beats_random else 'not every'} setting.")
    if not beats_freq:
        out.append(
            "- Why frequency wins on this model: REAP scores an expert by the *mean* of router weight × output "
            "norm over the tokens it receives. Here that mean varies little between experts and hardly tracks "
            "how many tokens they receive (the rank correlation above), so REAP keeps some experts that few "
            f"tokens reach and removes busy ones: its kept experts received {reap['routed_kept']:.1%} of the "
            f"calibration assignments, frequency's {freq['routed_kept']:.1%}, random's {rnd['routed_kept']:.1%}. "
            "Every token of a removed expert is re-routed to its next choice, so on a small model whose experts "
            "are weakly specialised the routed share kept predicts the damage: across the table, perplexity "
            "falls as *routed kept* rises, and EAN (norm only, no router weight) keeps the least and does worst.")
        out.append(
            "- The REAP paper reports its gains on models of tens of billions to a trillion parameters, where a "
            "rarely used expert can carry knowledge that frequency would discard; a 6M-parameter model trained "
            "on 20M tokens has little room for such experts. The table is what this model says, not a verdict on "
            "REAP at scale.")
    same = [(get(m, f, "code")["code_ppl"] < get(m, f, "prose")["code_ppl"]) and
            (get(m, f, "prose")["prose_ppl"] < get(m, f, "code")["prose_ppl"])
            for m in METRICS for f in sorted({r["fraction"] for r in rows if r["fraction"] > 0})]
    out.append(
        f"- Calibrating on the domain you care about pays: in {sum(same)} of {len(same)} (metric, fraction) "
        "pairs the model calibrated on a domain has the lower perplexity on that domain.")
    merges = [r for r in rows if r["method"] == "ream-merge"]
    if merges:
        m = get("ream-merge", top, "code")
        other = [(d, o) for d, o in (("code", "prose"), ("prose", "code"))]
        wins = [f"{f:.0%} {d}-calibrated on {o}" for f in sorted({r["fraction"] for r in merges}) for d, o in other
                if get("ream-merge", f, d)[f"{o}_ppl"] < get("reap", f, d)[f"{o}_ppl"]]
        out.append(
            f"- REAM merging (the defaults: REAM's own layerwise saliency, `--max-group-size 16`) against REAP pruning "
            f"to the same number of experts: {m['code_ppl']:.2f} vs {reap['code_ppl']:.2f} code perplexity at "
            f"{top:.0%} with code calibration ({'better' if m['code_ppl'] < reap['code_ppl'] else 'worse'} than "
            f"pruning); on the domain it was not calibrated on, merging is lower in {len(wins)} of "
            f"{2 * len({r['fraction'] for r in merges})} cases" + (f" ({', '.join(wins)})." if wins else "."))
        small = sorted({r["method"] for r in rows if r["method"].startswith("ream-merge C=")})
        if small:
            out.append(
                "- Smaller groups spread the merging over more centroids and cost more here: "
                + "; ".join(f"{name} gives {get(name, top, 'code')['code_ppl']:.2f}" for name in small)
                + f" code perplexity at {top:.0%}. Averaging experts of similar saliency moves the centroid "
                "further than folding low-saliency experts into a strong one.")
    return out


def control_lines(rows) -> list[str]:
    """One verdict line per (fraction, calibration domain, method): the method's perplexity on that domain's
    held-out text beside its control's (random pruning: every seed's range; REAM merging: REAP pruning at the same
    count), "beyond control" only when it lies outside the control's whole range on the better side."""
    out = []
    for fraction in sorted({r["fraction"] for r in rows if r["fraction"] > 0}):
        seeds = [r for r in rows if r["method"].startswith("random-s") and r["fraction"] == fraction]
        for d in DOMAINS:
            ppl = f"{d}_ppl"
            rnd = [s[ppl] for s in seeds]
            sel = {r["method"]: r for r in rows if r["fraction"] == fraction and r["calibration"] == d}
            for m in METRICS:
                v = sel[m][ppl]
                out.append(f"- {fraction:.0%}, {d} calibration, {d} ppl: {m} {v:.2f} vs random pruning "
                           f"{min(rnd):.2f}–{max(rnd):.2f} ({len(rnd)} seeds): "
                           + _verdict(v, [min(rnd), max(rnd)]))
            for name in sorted(k for k in sel if k.startswith("ream-merge")):
                v, reap = sel[name][ppl], sel["reap"][ppl]
                out.append(f"- {fraction:.0%}, {d} calibration, {d} ppl: {name} {v:.2f} vs REAP pruning to the "
                           f"same {sel[name]['experts']} experts {reap:.2f}: " + _verdict(v, [reap]))
    return out


def _verdict(value: float, control: list[float]) -> str:
    """Lower is better (perplexity): beyond the control only below its whole range."""
    if value < min(control):
        return "**beyond control** (lower)."
    if value > max(control):
        return "**worse than control**."
    return "**not beyond control** (within its range)."


def _down_note(model_dir) -> str:
    """What group size 64 does to this model's expert down projections (their input is the expert width)."""
    from mlx_fun.model.io import read_config

    width = read_config(model_dir).get("moe_intermediate_size")
    if not width or width % 64 == 0:
        return ""
    return (f"This model's expert down projections are {width} wide, which group size 64 does not divide, so the "
            "group-64 affine recipes leave them in float (nvfp4, group 16, quantizes them).")


def _device() -> str:
    dev = mx.default_device()
    try:
        name = mx.device_info().get("device_name", "")
    except Exception:  # noqa: BLE001 - device_info is backend-specific
        name = ""
    return f"{dev} {name}".strip() + f", {platform.machine()}, MLX {mx.__version__}"


def write_report(args, rows, config, model_dir, elapsed, calib, test, saliency):
    def f(x):
        return f"{x:.2f}"

    lines = [
        "# Quality: pruning and merging the bundled trained MoE",
        "",
        f"Generated by `python -m scripts.benchmarks.bench_quality` ({elapsed / 60:.1f} min on {_device()}).",
        "",
        f"Model: `{model_dir.name}` ({config['model_type']}, {config['num_hidden_layers']} layers × "
        f"{config['num_experts']} experts, top-{config['num_experts_per_tok']}). Calibration: "
        f"{args.calib_samples} samples × ≤{args.max_tokens} tokens of the train split of each domain "
        f"({', '.join(f'{d} {sum(map(len, s)):,}' for d, s in calib.items())} tokens). Test: "
        f"{args.max_eval_samples} samples × ≤{args.max_tokens} tokens of the held-out test split "
        f"({', '.join(f'{d} {sum(map(len, s)):,}' for d, s in test.items())} tokens). KL is the mean "
        "next-token KL(original ‖ model) in nats. Random rows do not depend on calibration; the mean of "
        f"{args.random_seeds} seeds is shown (single seeds in the JSON/console output).",
        "",
        "| removed | calibration | method | experts | code ppl | prose ppl | code KL | prose KL | routed kept |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["method"].startswith("random-s"):
            continue
        lines.append(f"| {r['fraction']:.0%} | {r['calibration']} | {r['method']} | {r['experts']} | "
                     f"{f(r['code_ppl'])} | {f(r['prose_ppl'])} | {r['code_kl']:.3f} | {r['prose_kl']:.3f} | "
                     + (f"{r['routed_kept']:.1%} |" if "routed_kept" in r else "— |"))
    lines += ["", "*routed kept*: share of the calibration domain's expert assignments (token × top-k slots) that "
              "went to experts the selection keeps (random rows: against code calibration).", "",
              "## What the numbers say", ""]
    for fraction in sorted({r["fraction"] for r in rows if r["fraction"] > 0}):
        for d in DOMAINS:
            sel = {r["method"]: r for r in rows if r["fraction"] == fraction and r["calibration"] in (d, "-")
                   and not r["method"].startswith("random-s")}
            rnd = next(v for k, v in sel.items() if k.startswith("random ("))
            ranked = sorted((v[f"{d}_ppl"], k) for k, v in sel.items() if k != "original")
            lines.append(
                f"- {fraction:.0%} removed, {d} calibration, {d} perplexity: "
                + ", ".join(f"{k} {v:.2f}" for v, k in ranked)
                + f". REAP {'<' if sel['reap'][f'{d}_ppl'] < sel['freq'][f'{d}_ppl'] else '≥'} freq, "
                f"REAP {'<' if sel['reap'][f'{d}_ppl'] < rnd[f'{d}_ppl'] else '≥'} random.")
    lines += ["", "## Against the controls", "",
              "Each method beside the control that would expose it, on the held-out test split: a saliency "
              "criterion against random pruning (every seed), REAM merging against REAP pruning to the same "
              "number of experts. \"beyond control\": outside the controls' whole range.", ""]
    lines += control_lines(rows)
    rho = {d: spearman_reap_freq(saliency[d]) for d in DOMAINS}
    lines += ["", "Rank correlation between REAP and freq scores (mean over layers): "
              + ", ".join(f"{d} calibration {v:.2f}" for d, v in rho.items()) + "."]
    lines += ["", "## Reading", "", *interpretation(rows)]
    write_text(args.output, "\n".join(lines) + "\n", force=True)  # a report page this script regenerates
    print(f"wrote {args.output}", flush=True)
    print(json.dumps({"elapsed_s": round(elapsed, 1)}))


if __name__ == "__main__":
    main()
