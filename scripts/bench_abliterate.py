#!/usr/bin/env python3
"""Does abliteration remove refusals on the bundled refusing chat model, at what cost — float and 4-bit?

    python scripts/bench_abliterate.py [--model data/tiny-moe-chat] [--data data/safety] [--search 12]
                                       [--output docs/benchmarks/abliterate.md]
    python scripts/bench_abliterate.py --quick [--baseline REV] [--repeat N]

``--quick`` times the README example only: ``abliterate_wall``, beside ``collect_wall`` (collect over the same
capture prompts, what one forward of each costs) and ``baseline_wall``, the same example on the code of git
revision ``--baseline`` (default: before abliterate ran on the forward engine), each in a fresh process.

In one run: a 4-bit copy of the model (mlx-lm's convert), a safety scan (for ``--target safety-experts``), then
``mlx-fun abliterate`` (the job, default settings: single direction, one direction per refusal phrasing, 2 rounds)
for ``--target all`` (prompt-subset seeds 0, 1, 2), ``dense-only`` and ``safety-experts`` on the float and the 4-bit
model, one round only, the previous default (one direction a round, 3 rounds), and ``--search``. Directions from
the *train* prompt sets; refusal rate (greedy, 16 tokens, ``mlx_fun.refusal.is_refusal``) and benign first-token
KL on the held-out *test* sets (other phrasings, two categories never seen in training); the held-out harmful
prompts' last-token residual projected on the first direction, averaged over the abliterated layers, before and
after; the model's size on disk before and after. Writes the table and what it means to --output.
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


#: the code before abliterate ran on the forward engine (issue 31 part 1): --quick's default baseline
BASELINE = "f3057af"

#: the README example, timed in a fresh process (argv: model, data dir, output dir); prints one JSON line
EXAMPLE = """
import json, sys, time
from mlx_fun.blas import maybe_reexec
maybe_reexec()
from pathlib import Path
from mlx_fun.jobs import abliterate
model, data, out = sys.argv[1:4]
d = Path(data)
held = dict(eval_harmful_dataset=d / "harmful_test.jsonl", eval_benign_dataset=d / "benign_test.jsonl")
try:  # the evaluation option group (since issue 31 part 2)
    from mlx_fun.rewrite.abliterate_options import Evaluation
    held = dict(evaluation=Evaluation(**held))
except ImportError:  # an earlier revision's code (--baseline): flat keywords
    pass
t = time.perf_counter()
r = abliterate.run(model=model, harmful_dataset=d / "harmful_train.jsonl", benign_dataset=d / "benign_train.jsonl",
                   output=out, seed=0, **held)
print(json.dumps({"wall": time.perf_counter() - t, "before": r.before.row(), "after": r.after.row(),
                  "code": str(Path(abliterate.__file__).parents[2])}))
"""


def _example(model, data, out, pythonpath=None) -> dict:
    import json
    import os
    import subprocess

    env = dict(os.environ, **({"PYTHONPATH": pythonpath} if pythonpath else {}))
    done = subprocess.run([sys.executable, "-c", EXAMPLE, str(Path(model).resolve()), str(Path(data).resolve()),
                           str(out)], env=env, check=True, capture_output=True, text=True,
                          cwd=pythonpath or str(ROOT))  # not a directory holding another mlx_fun
    return json.loads(done.stdout.strip().splitlines()[-1])


def _checkout(rev: str, where: Path) -> Path:
    """``mlx_fun`` as it was at ``rev`` (git archive), importable from ``where``."""
    import subprocess

    where.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "mlx_fun"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive.stdout, check=True)
    return where


def quick(args) -> int:
    """abliterate_wall (the README example), collect_wall (collect over the same capture prompts: one forward of
    each) and, with a baseline revision, the same example on its code; each in a fresh process, fastest of
    --repeat."""
    import time

    from mlx_fun import jobs

    data, tmp = Path(args.data), Path(tempfile.mkdtemp())
    base = _checkout(args.baseline, tmp / "baseline") if args.baseline not in ("", "none") else None
    new, old = [], []
    for i in range(max(1, args.repeat)):
        if base is not None:
            old.append(_example(args.model, data, tmp / f"old{i}", str(base)))
        new.append(_example(args.model, data, tmp / f"new{i}"))
    collect = []
    for i in range(max(1, args.repeat)):
        t = time.perf_counter()
        for name in ("harmful_train", "benign_train"):
            jobs.collect.run(model=args.model, dataset=data / f"{name}.jsonl", output=tmp / f"{name}{i}.npz",
                             max_samples=args.max_samples, seed=0)
        collect.append(time.perf_counter() - t)
    best = min(new, key=lambda r: r["wall"])
    print(f"abliterate_wall {best['wall']:.2f} s  (README example; after: {_outcome(best)})")
    print(f"collect_wall {min(collect):.2f} s  (collect over the same {args.max_samples} + {args.max_samples} "
          "capture prompts)")
    if old:
        was = min(old, key=lambda r: r["wall"])
        assert was["code"] == str(base) and best["code"] == str(ROOT), (was["code"], best["code"])
        print(f"baseline_wall {was['wall']:.2f} s  (revision {args.baseline}; after: {_outcome(was)})")
        print(f"speedup {was['wall'] / best['wall']:.2f}x")
    return 0


def _outcome(r: dict) -> str:
    a = r["after"]
    return f"harmful refusal {a['harmful_refusal']:.1%}, benign refusal {a['benign_refusal']:.1%}, KL {a['benign_kl']:.3f}"


def main() -> int:
    from mlx_fun.blas import maybe_reexec

    maybe_reexec()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "data" / "tiny-moe-chat"))
    ap.add_argument("--data", default=str(ROOT / "data" / "safety"))
    ap.add_argument("--max-samples", type=int, default=128)
    ap.add_argument("--eval-samples", type=int, default=128)
    ap.add_argument("--search", type=int, default=6)
    ap.add_argument("--output", default=str(ROOT / "docs" / "benchmarks" / "abliterate.md"))
    ap.add_argument("--quick", action="store_true",
                    help="Only time the README example (abliterate_wall) beside collect over the same prompts "
                         "(collect_wall) and, with --baseline, the same example on that git revision's code.")
    ap.add_argument("--baseline", default=BASELINE, metavar="REV",
                    help="With --quick: the git revision to time beside (''/none: none).")
    ap.add_argument("--repeat", type=int, default=1, help="With --quick: runs of each, the fastest kept.")
    args = ap.parse_args()
    if args.quick:
        return quick(args)

    from mlx_lm import convert

    from mlx_fun import jobs
    from mlx_fun.io import dir_size
    from mlx_fun.settings import grouped
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
    F, Q = ("float", args.model), ("4-bit", str(q4))
    old = {"phrasings": 1, "rounds": 3}  # the previous default: one direction a round
    runs = [(F, "all", {}), (F, "all", {"seed": 1}), (F, "all", {"seed": 2}), (F, "dense-only", {}),
            (F, "safety-experts", {}), (F, "all", {"rounds": 1}), (F, "all", old),
            (F, "all", {"direction": "per-layer", "rounds": 1, "phrasings": 1}),
            (Q, "all", {}), (Q, "all", {"seed": 1}), (Q, "all", {"seed": 2}), (Q, "dense-only", {}),
            (Q, "safety-experts", {}), (Q, "all", {"rounds": 1}), (Q, "all", old),
            (F, "all", {"search": args.search}), (Q, "all", {"search": args.search})]
    for n, ((fmt, model), target, extra) in enumerate(runs):
        out = tmp / f"out{n}"
        kw = dict(common, **extra, **({"safety_map": report} if target == "safety-experts" else {}))
        r = jobs.abliterate.run(model=model, output=out, **grouped(jobs.abliterate.run, dict(kw, target=target)))
        dirs = r.directions
        p0 = projection(model, data / "harmful_test.jsonl", r.layers, dirs, args.eval_samples)
        p1 = projection(out, data / "harmful_test.jsonl", r.layers, dirs, args.eval_samples)
        how = ", ".join(f"{k} {v}" for k, v in extra.items()) or "defaults"
        row = (fmt, target, how, r.layers, r.weight, r.direction_layer,
               "+".join(str(len(x.dirs)) for x in r.rounds), r.before.harmful_refusal,
               r.after.harmful_refusal, r.before.benign_refusal, r.after.benign_refusal, r.after.benign_kl, p0, p1,
               dir_size(model), dir_size(out))
        rows.append(row)
        print(" | ".join(map(str, row)), flush=True)
    write_text(args.output, _markdown(rows, args))
    print(f"wrote {args.output}")
    return 0


def _markdown(rows, args) -> str:
    table = "\n".join(
        f"| {fmt} | {target} | {how} | {','.join(map(str, layers))} | {w:g} | "
        f"{'per-layer' if src is None else src} | {nr} | {h0:.1%} → {h1:.1%} | {b0:.1%} → {b1:.1%} | {kl:.3f} | "
        f"{p0:.2f} → {p1:.2f} | {s0 / 1e6:.1f} → {s1 / 1e6:.1f} MB |"
        for fmt, target, how, layers, w, src, nr, h0, h1, b0, b1, kl, p0, p1, s0, s1 in rows)
    return f"""# Abliteration on the bundled refusing chat model

`python scripts/bench_abliterate.py --search {args.search}` (model `{Path(args.model).name}` and its 4-bit copy,
mlx-lm's convert, group size 32). Directions from {args.max_samples} harmful + {args.max_samples} benign *train*
prompts (the residual after each decoder layer at the prompt's last token; each round uses the harmful ones the
model still refuses and the benign ones it answers); refusals (greedy, 16 tokens, `mlx_fun.refusal.is_refusal`) and
benign first-token KL(original ‖ abliterated) on {args.eval_samples} held-out harmful and {args.eval_samples}
held-out benign prompts (other phrasings, and two harm categories the model never saw in training).
"projection": the held-out harmful prompts' mean last-token residual · the first round's direction, averaged over
the abliterated layers, before → after. Defaults: `--direction single` (measured after the layer with the largest
un-normalised difference, removed from every layer's writers and the embedding), `--phrasings 4` (one direction per
refusal phrasing a round), `--rounds 2` (a later round that takes the *train* benign prompts' KL over 0.5 is
undone), seed 0 for the prompt subsets (train and held-out); `search`: `--search {args.search}` (layers × direction
layer × weight, each measured after every round; fewest refusals with KL ≤ 0.5). "rounds": directions removed in
each round.

| format | target | settings | layers | weight | direction layer | rounds | harmful refusal | benign refusal | benign KL | projection | size |
|---|---|---|---|---|---|---|---|---|---|---|---|
{table}

{_summary(rows)}
"""


def _summary(rows) -> str:
    """What the table says, computed from it: the goal (<= 10% refusals at KL <= 0.5) row by row, the seed spread."""
    met = [f"{r[0]} {r[1]} ({r[2]}): {r[8]:.1%} at KL {r[11]:.3f}" for r in rows if r[8] <= 0.10 and r[11] <= 0.5]
    out = ["Rows that reach the goal of <= 10% held-out refusals at benign KL <= 0.5: "
           + ("; ".join(met) if met else "none") + "."]
    for fmt in ("float", "4-bit"):
        spread = [r for r in rows if r[0] == fmt and r[1] == "all" and (r[2] == "defaults" or r[2].startswith("seed"))]
        if len(spread) > 1:
            out.append(f"{fmt}, defaults, over the prompt subsets' seed: held-out refusals "
                       f"{min(r[8] for r in spread):.1%}-{max(r[8] for r in spread):.1%}, benign KL "
                       f"{min(r[11] for r in spread):.3f}-{max(r[11] for r in spread):.3f}.")
    out.append("`safety-experts` touches only the scanned experts' down projections and leaves refusals where they "
               "were; the sizes stay within 0.02%: quantized writers keep their bits, group size and mode.")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
