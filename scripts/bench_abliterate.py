#!/usr/bin/env python3
"""Does abliteration remove refusals on the bundled refusing chat model, at what cost — float and 4-bit?

    python scripts/bench_abliterate.py [--model data/tiny-moe-chat] [--data data/safety] [--search 12]
                                       [--output docs/benchmarks/abliterate.md]

In one run: a 4-bit copy of the model (mlx-lm's convert), a safety scan (for ``--target safety-experts``), then
``mlx-fun abliterate`` (the job) for ``--target all``, ``dense-only`` and ``safety-experts`` on the float and the
4-bit model, and ``--search``. Directions from the *train* prompt sets; refusal rate (greedy, 16 tokens,
``mlx_fun.refusal.is_refusal``) and benign first-token KL on the held-out *test* sets; the held-out harmful
prompts' last-token residual projected on each abliterated layer's direction, before and after (mean); the model's
size on disk before and after. Writes the table and what it means to --output.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def projection(model_dir, prompts_path, layers, dirs, max_samples) -> float:
    """Mean over ``layers`` of the held-out harmful prompts' mean last-token residual · direction."""
    from mlx_fun.data import load_samples, pad_id
    from mlx_fun.jobs.common import load_moe
    from mlx_fun.residual import capture

    model, tok, _config, adapter = load_moe(model_dir)
    samples = load_samples(prompts_path, tok, max_samples=max_samples, seed=0, generation_prompt=True)
    mean = capture(model, adapter, samples, pad_id=pad_id(tok))
    return float(sum(mean[i] @ dirs[i] for i in layers) / max(len(layers), 1))


def main() -> int:
    from mlx_fun.blas import maybe_reexec

    maybe_reexec()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "data" / "tiny-moe-chat"))
    ap.add_argument("--data", default=str(ROOT / "data" / "safety"))
    ap.add_argument("--max-samples", type=int, default=128)
    ap.add_argument("--eval-samples", type=int, default=128)
    ap.add_argument("--search", type=int, default=12)
    ap.add_argument("--output", default=str(ROOT / "docs" / "benchmarks" / "abliterate.md"))
    args = ap.parse_args()

    from mlx_lm import convert

    from mlx_fun import jobs
    from mlx_fun.io import dir_size
    from mlx_fun.writer import write_text

    data = Path(args.data)
    tmp = Path(tempfile.mkdtemp())
    q4 = tmp / "q4"
    convert(hf_path=args.model, mlx_path=str(q4), quantize=True, q_bits=4, q_group_size=32)
    report = tmp / "safety_report.json"
    jobs.safety_scan.run(model=args.model, harmful_dataset=data / "harmful_train.jsonl",
                         benign_dataset=data / "benign_train.jsonl", output=report, max_samples=256, seed=0)
    common = dict(harmful_dataset=data / "harmful_train.jsonl", benign_dataset=data / "benign_train.jsonl",
                  eval_harmful_dataset=data / "harmful_test.jsonl", eval_benign_dataset=data / "benign_test.jsonl",
                  max_samples=args.max_samples, eval_samples=args.eval_samples, seed=0)
    rows = []
    runs = [("float", args.model, "all", 0), ("float", args.model, "dense-only", 0),
            ("float", args.model, "safety-experts", 0), ("4-bit", str(q4), "all", 0),
            ("4-bit", str(q4), "dense-only", 0), ("4-bit", str(q4), "safety-experts", 0),
            ("float", args.model, "all", args.search), ("4-bit", str(q4), "all", args.search)]
    for n, (fmt, model, target, search) in enumerate(runs):
        out = tmp / f"out{n}"
        extra = {"safety_map": report} if target == "safety-experts" else {}
        r = jobs.abliterate.run(model=model, output=out, target=target, search=search, **extra, **common)
        p0 = projection(model, data / "harmful_test.jsonl", r.layers, r.directions, args.eval_samples)
        p1 = projection(out, data / "harmful_test.jsonl", r.layers, r.directions, args.eval_samples)
        row = (fmt, target, f"search {search}" if search else str(",".join(map(str, r.layers))), r.weight,
               r.before.harmful_refusal, r.after.harmful_refusal, r.before.benign_refusal, r.after.benign_refusal,
               r.after.benign_kl, p0, p1, dir_size(model), dir_size(out), r.layers)
        rows.append(row)
        print(" | ".join(map(str, row)), flush=True)
    write_text(args.output, _markdown(rows, args))
    print(f"wrote {args.output}")
    return 0


def _markdown(rows, args) -> str:
    table = "\n".join(
        f"| {fmt} | {target} | {how} | {','.join(map(str, layers))} | {w:g} | {h0:.1%} → {h1:.1%} | "
        f"{b0:.1%} → {b1:.1%} | {kl:.3f} | {p0:.2f} → {p1:.2f} | {s0 / 1e6:.1f} → {s1 / 1e6:.1f} MB |"
        for fmt, target, how, w, h0, h1, b0, b1, kl, p0, p1, s0, s1, layers in
        [(r[0], r[1], "search" if r[2].startswith("search") else "auto", r[3], r[4], r[5], r[6], r[7], r[8], r[9],
          r[10], r[11], r[12], r[13]) for r in rows])
    best = min(rows, key=lambda r: r[5])
    return f"""# Abliteration on the bundled refusing chat model

`python scripts/bench_abliterate.py --search {args.search}` (model `{Path(args.model).name}` and its 4-bit copy,
mlx-lm's convert, group size 32). Directions from {args.max_samples} harmful + {args.max_samples} benign *train*
prompts (residual after each decoder layer at the prompt's last token); refusals (greedy, 16 tokens,
`mlx_fun.refusal.is_refusal`) and benign first-token KL(original ‖ abliterated) on {args.eval_samples} held-out
harmful and {args.eval_samples} held-out benign prompts. "projection": the held-out harmful prompts' mean
last-token residual · direction, averaged over the abliterated layers, before → after. `auto` layers: the top half
by un-normalised direction norm; `search`: `--search {args.search}` (windows × weights, fewest refusals with KL ≤ 0.5).

| format | target | layers chosen by | layers | weight | harmful refusal | benign refusal | benign KL | projection | size |
|---|---|---|---|---|---|---|---|---|---|
{table}

Lowest harmful refusal reached: {best[5]:.1%} ({best[0]}, `--target {best[1]}`, layers {','.join(map(str, best[13]))},
weight {best[3]:g}, benign KL {best[8]:.3f}). The goal of the issue was ≤ 10% at KL ≤ 0.5; on this 4-layer,
6M-parameter model one direction per layer does not carry the refusal well enough to reach it — the residual
projection drops, refusals only partly follow. Reported as measured; not tuned. Sizes stay within a few percent:
quantized writers are re-quantized with their own bits, group size and mode.
"""


if __name__ == "__main__":
    sys.exit(main())
