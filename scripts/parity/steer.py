#!/usr/bin/env python3
"""SteerMoE / SAFEx parity: the experts each selects on the same prompts, and what steering them does, beside
`mlx-fun safety-scan` / `steer` and beside random experts.

    python -m scripts.parity.steer --reference /work/refs/SteerMoE --safex /work/refs/SAFEx \
        --python /work/venvs/ref45b/bin/python [--model data/tiny-moe-chat] [--samples 128]

The model is exported to transformers' layout (:mod:`scripts.tools.export_transformers`); both sides run that
float copy (mlx_lm reads it back). The same prompt token ids (``--samples`` harmful and benign *train* prompts,
drawn as ``safety-scan`` draws them, seed 0) go to ``safety-scan`` and to the references
(:mod:`scripts.parity.steer_reference`, in ``--python``). Printed, number against number:

1. selection: SAFEx trace.py's per-expert counts vs the scan's; SteerMoE's ``risk_diff`` vs the scan's
   ``risk_difference``; the overlap of SteerMoE's top experts by |risk_diff| (its ranking, over all layers) with
   the scan's HCDG / HRCG / safety-critical groups (ranked by the risk difference over all layers too).
2. steering: for each setting (the references' rule on their own choice, our modes, random experts in the same
   layers, 3 seeds), refusal on the held-out hand-written harmful prompts and degenerate replies over all
   evaluation replies, the reference (transformers, SteerMoE's routing block) beside ours (MLX, ``--scheme rank``
   or the mode's scheme), and the largest difference of their next-token log-probs on a few prompts.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reference", required=True, type=Path, help="adobe-research/SteerMoE's tree")
    ap.add_argument("--safex", required=True, type=Path, help="Bearisbug/SAFEx's tree")
    ap.add_argument("--python", required=True, help="a Python with torch, transformers 4.x, pandas")
    ap.add_argument("--model", default=str(ROOT / "data" / "tiny-moe-chat"))
    ap.add_argument("--data", default=str(ROOT / "data" / "safety"))
    ap.add_argument("--samples", type=int, default=128, help="harmful and benign train prompts each")
    ap.add_argument("--safe-experts", type=int, default=15,
                    help="SteerMoE safe: experts activated (Mixtral's 20 of 256 in the paper's table, scaled to 192)")
    ap.add_argument("--unsafe-experts", type=int, default=40, help="SteerMoE unsafe: experts deactivated")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--work", default=None, help="work directory (default: a temporary one)")
    return ap.parse_args()


def per_layer(sets: dict) -> dict[int, int]:
    return {int(k): len(v) for k, v in sets.items() if v}


def random_like(counts: dict[int, int], E: int, seed: int) -> dict[str, list[int]]:
    r = random.Random(seed)
    return {str(k): sorted(r.sample(range(E), n)) for k, n in sorted(counts.items())}


def jaccard(a: set, b: set) -> float:
    return len(a & b) / max(1, len(a | b))


def pairs(sets: dict) -> set[tuple[int, int]]:
    return {(int(k), int(e)) for k, v in sets.items() for e in v}


def main() -> int:
    args = parse()
    from mlx_lm import load

    from mlx_fun import jobs
    from mlx_fun.adapters import get_adapter
    from mlx_fun.datasets.calibration import Calibration
    from mlx_fun.experts.steering import for_adapter
    from mlx_fun.model import moe_hook
    from mlx_fun.model.io import read_config
    from mlx_fun.observe.refusal import degenerate_rate, first_token_logprobs, greedy_replies, refusal_rate
    from scripts.lib.chat import read
    from scripts.parity.common import exported

    work = Path(args.work or tempfile.mkdtemp(prefix="parity-steer-"))
    work.mkdir(parents=True, exist_ok=True)
    hf = exported(args.model, work)
    data = Path(args.data)
    model, tok = load(str(hf))
    adapter = get_adapter(model, read_config(hf))
    E = adapter.num_experts
    cal = Calibration(max_samples=args.samples, seed=0)
    harmful = cal.load(data / "harmful_train.jsonl", tok, generation_prompt=True)
    benign = cal.load(data / "benign_train.jsonl", tok, generation_prompt=True)
    scan = jobs.safety_scan.run(model=hf, harmful_dataset=data / "harmful_train.jsonl",
                                benign_dataset=data / "benign_train.jsonl", output=work / "safety_report.json",
                                force=True, calibration=Calibration(max_samples=args.samples, seed=0, batch_size=4))
    rep = scan.report

    def chat(name):
        return [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True)
                for r in read(data / name)]

    hw_harmful = chat("harmful_handwritten_test.jsonl")
    hw_benign = chat("benign_handwritten_test.jsonl") + chat("lookalike_handwritten_test.jsonl")
    evals = hw_harmful + hw_benign
    logit_prompts = hw_harmful[:8] + hw_benign[:8]

    ours_safe = for_adapter(adapter, safety_map=work / "safety_report.json", safety_mode="safe", scheme="rank")
    ours_unsafe = for_adapter(adapter, safety_map=work / "safety_report.json", safety_mode="unsafe")
    settings = [{"name": "original", "kind": "manual"},
                {"name": "SteerMoE safe (activate)", "kind": "steermoe", "pos": args.safe_experts, "neg": 0,
                 "reverse": 0},
                {"name": "SteerMoE unsafe (deactivate)", "kind": "steermoe", "pos": 0, "neg": args.unsafe_experts,
                 "reverse": 1},
                {"name": "ours unsafe: HCDG masked", "kind": "manual",
                 "deactivate": {str(k): v for k, v in ours_unsafe.deactivate.items()}},
                {"name": "ours safe: HCDG activated (rank)", "kind": "manual",
                 "activate": {str(k): v for k, v in ours_safe.activate.items()}}]
    job = {"sets": {"harmful": harmful, "benign": benign}, "eval": evals, "logit_prompts": logit_prompts,
           "max_tokens": args.max_tokens, "settings": settings}
    ref = run_reference(args, hf, work, job)
    # the controls need the references' own choice: a second pass with random experts in the same layers
    chosen = {s["name"]: s for s in ref["settings"]}
    controls = []
    for name, key in (("SteerMoE safe (activate)", "activate"), ("SteerMoE unsafe (deactivate)", "deactivate"),
                      ("ours unsafe: HCDG masked", "deactivate"), ("ours safe: HCDG activated (rank)", "activate")):
        counts = per_layer(chosen[name][key])
        for seed in range(3):
            controls.append({"name": f"random {key}d like '{name}' (seed {seed})", "kind": "manual",
                             key: random_like(counts, E, seed)})
    job["settings"] = controls
    ref["settings"] += run_reference(args, hf, work, job, tag="controls")["settings"]

    print("\n== selection on the same prompts "
          f"({len(harmful)} harmful, {len(benign)} benign train prompts, {sum(map(len, harmful))} + "
          f"{sum(map(len, benign))} tokens)")
    compare_selection(ref, rep, E)
    print("\n== steering: held-out hand-written prompts "
          f"({len(hw_harmful)} harmful, {len(hw_benign)} benign + lookalike), greedy {args.max_tokens} tokens")
    print(f"{'setting':<58} {'experts':>7}  {'harmful refusal ref | ours':>26}  {'degenerate ref | ours':>22}  "
          f"{'max |dlogp|':>11}")
    for s in ref["settings"]:
        steer = for_adapter(adapter, activate=s.get("activate") or None, deactivate=s.get("deactivate") or None,
                            scheme="rank")
        moe_hook.install(adapter, [], steer.route_steers(adapter))
        try:
            ours = greedy_replies(model, tok, evals, args.max_tokens)
            lp = np.array(first_token_logprobs(model, logit_prompts))
        finally:
            moe_hook.remove(adapter)
        theirs = [tok.decode(ids) for ids in s["replies"]]
        n = len(hw_harmful)
        dlp = float(np.max(np.abs(lp - np.array(s["logprobs"]))))
        k = sum(len(v) for v in (s.get("activate") or {}).values()) + \
            sum(len(v) for v in (s.get("deactivate") or {}).values())
        print(f"{s['name']:<58} {k:>7}  {refusal_rate(theirs[:n]):>12.1%} | {refusal_rate(ours[:n]):<11.1%}  "
              f"{degenerate_rate(tok, theirs):>9.1%} | {degenerate_rate(tok, ours):<10.1%}  {dlp:>11.2e}",
              flush=True)
    (work / "reference.json").write_text(json.dumps(ref))
    print(f"\nreference: torch {ref['torch']}, transformers {ref['transformers']}; work directory {work}")
    return 0


def run_reference(args, hf: Path, work: Path, job: dict, tag: str = "main") -> dict:
    job_path, out = work / f"job-{tag}.json", work / f"reference-{tag}.json"
    job_path.write_text(json.dumps(job))
    cmd = [args.python, str(ROOT / "scripts" / "parity" / "steer_reference.py"), "--steermoe", str(args.reference),
           "--safex", str(args.safex), "--model", str(hf), "--job", str(job_path), "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"Error: the reference side failed (exit {done.returncode}): {' '.join(cmd)}")
    return json.loads(out.read_text())


def compare_selection(ref: dict, rep: dict, E: int) -> None:
    cols = ref["steermoe_columns"]
    t = np.array(ref["steermoe_table"])
    layers = rep["moe_layer_indices"]
    L = len(layers)
    risk = np.zeros((L, E))
    risk[t[:, cols.index("layer")].astype(int), t[:, cols.index("expert")].astype(int)] = t[:, cols.index("risk_diff")]
    ours_risk = np.array(rep["scores"]["risk_difference"])
    print(f"SteerMoE risk_diff vs scan risk_difference: max |diff| {np.max(np.abs(risk - ours_risk)):.2e} "
          f"(scan rounds to 1e-6)")
    for name, side in (("harmful", "harmful"), ("benign", "benign")):
        usage = np.array(ref["safex"][name]["input_expert_usage"])
        rate = np.array(rep["per_dataset"][side]["activation_rate"])
        tokens = rep["per_dataset"][side]["tokens"]
        same = int(np.sum(np.abs(usage - np.round(rate * tokens)) < 0.5))
        print(f"SAFEx trace.py input_expert_usage ({name}) vs scan counts: {same} of {usage.size} equal; "
              f"max |diff| {np.max(np.abs(usage - rate * tokens)):.3g}; total over layers {usage.sum():.0f} vs "
              f"{tokens * rep['top_k'] * len(layers)}")
    order = np.argsort(-np.abs(risk), axis=None, kind="stable")
    groups = {"safety_critical": rep["safety_critical"], "hcdg": rep["hcdg"], "hrcg": rep["hrcg"]}
    for name, g in groups.items():
        ours = pairs(g)
        if name == "hcdg":
            cand = [i for i in np.argsort(-risk, axis=None, kind="stable") if risk.flat[i] > 0]
        elif name == "hrcg":
            cand = [i for i in np.argsort(risk, axis=None, kind="stable") if risk.flat[i] < 0]
        else:
            cand = list(order)
        top = {(int(i // E), int(i % E)) for i in cand[:len(ours)]}
        print(f"{name:<16} scan {len(ours):3d} experts; SteerMoE's top {len(ours)} by "
              f"{'|risk_diff|' if name == 'safety_critical' else 'risk_diff'}: {len(ours & top)} shared "
              f"(Jaccard {jaccard(ours, top):.2f})")


if __name__ == "__main__":
    sys.exit(main())
