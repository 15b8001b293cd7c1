#!/usr/bin/env python3
"""Does steering the scanned safety experts change refusals — more than steering random experts does?

    python -m scripts.benchmarks.bench_safety [--model data/tiny-moe-chat] [--data data/safety] [--max-samples 256]
                                              [--output docs/benchmarks/safety.md]

On the bundled refusing chat model, in one run: `safety-scan` on the *train* prompt sets, then, on the held-out
*test* prompts and the hand-written ones (never trained on), greedy replies (16 tokens) classified by
`mlx_fun.observe.refusal.is_refusal` and `mlx_fun.observe.refusal.is_degenerate` (a token or a short block of tokens repeated
4 times in a row: the reply is no longer text), and the benign next-token
KL(original ‖ steered) at the first assistant position, for: the original; the safety-critical experts masked
(`unsafe`); as many random experts masked in the same layers (control, 3 seeds); the HCDG experts masked; the
HRCG experts boosted (`safe`); each with the additive and the rank scheme of `mlx_fun.experts.steering` on the hooked MoE
call (what `steer` and `serve` apply). Writes the table and what it means to --output.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

from scripts.lib.chat import answer, read
from scripts.lib.options import add_chat_data, add_report


def main() -> int:
    from mlx_fun.runtime.blas import maybe_reexec

    maybe_reexec()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_chat_data(ap)
    ap.add_argument("--max-samples", type=int, default=256)
    ap.add_argument("--benign-test", type=int, default=300, help="held-out benign prompts used")
    add_report(ap, "safety.md")
    args = ap.parse_args()

    from mlx_lm import load

    from mlx_fun import jobs
    from mlx_fun.model import moe_hook
    from mlx_fun.adapters import get_adapter
    from mlx_fun.model.io import read_config
    from mlx_fun.observe.refusal import degenerate_rate, first_token_logprobs, mean_kl, refusal_rate
    from mlx_fun.experts.steering import for_adapter
    from mlx_fun.core.writer import write_text

    data = Path(args.data)
    tmp = tempfile.TemporaryDirectory()
    report_path = Path(tmp.name) / "safety_report.json"
    scan = jobs.safety_scan.run(model=args.model, harmful_dataset=data / "harmful_train.jsonl",
                                benign_dataset=data / "benign_train.jsonl", output=report_path,
                                max_samples=args.max_samples, seed=0)
    rep = scan.report
    model, tok = load(args.model)
    adapter = get_adapter(model, read_config(args.model))
    E = adapter.num_experts
    harmful = read(data / "harmful_test.jsonl")
    benign = read(data / "benign_test.jsonl")[:args.benign_test]
    hw_harmful = read(data / "harmful_handwritten_test.jsonl")
    hw_benign = read(data / "benign_handwritten_test.jsonl") + read(data / "lookalike_handwritten_test.jsonl")
    prompts = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True) for r in benign]
    reference = first_token_logprobs(model, prompts)

    def measure(label, **steer):
        s = for_adapter(adapter, **steer)
        moe_hook.install(adapter, [], s.route_steers(adapter))
        try:
            replies = [answer(model, tok, rows) for rows in (harmful, benign, hw_harmful, hw_benign)]
            h, b, hh, hb = map(refusal_rate, replies)
            deg = degenerate_rate(tok, [r for rs in replies for r in rs])
            kl = mean_kl(reference, first_token_logprobs(model, prompts))
        finally:
            moe_hook.remove(adapter)
        n = sum(map(len, (s.deactivate | s.activate).values()))
        row = (label, "—" if s.empty else s.scheme, n, h, b, kl, hh, hb, deg)
        print(f"{label:<40} {s.scheme:<8} experts {n:3d}  harmful refusal {h:6.1%}  benign refusal {b:6.1%}  "
              f"benign KL {kl:.4f}  hand-written harmful {hh:6.1%} benign {hb:6.1%}  degenerate {deg:6.1%}",
              flush=True)
        return row

    critical = rep["safety_critical"]
    rows = [measure("original")]
    for scheme in ("additive", "rank"):
        rows.append(measure("unsafe: safety-critical masked", safety_map=report_path, safety_mode="unsafe",
                            scheme=scheme))
        for seed in range(3):
            r = random.Random(seed)
            rnd = {layer: sorted(r.sample(range(E), len(v))) for layer, v in critical.items()}
            rows.append(measure(f"control: random masked (seed {seed})", deactivate=rnd, scheme=scheme))
        rows.append(measure("HCDG masked", deactivate=rep["hcdg"], scheme=scheme))
        rows.append(measure("safe: HRCG boosted (≤ top_k per layer)", safety_map=report_path, safety_mode="safe",
                            scheme=scheme))
    tmp.cleanup()
    write_text(args.output, _markdown(rows, rep, harmful, benign, (hw_harmful, hw_benign), args),
               force=True)  # a report page this script regenerates
    print(f"wrote {args.output}")
    return 0


def _markdown(rows, rep, harmful, benign, handwritten, args) -> str:
    table = "\n".join(f"| {label} | {scheme} | {n} | {h:.1%} | {b:.1%} | {hh:.1%} | {hb:.1%} | {deg:.1%} | {kl:.4f} |"
                      for label, scheme, n, h, b, kl, hh, hb, deg in rows)
    orig = rows[0][3]

    def pick(label, scheme):
        return [r for r in rows if r[0].startswith(label) and r[1] == scheme]

    lines = []
    for scheme in ("additive", "rank"):
        unsafe, ctrl = pick("unsafe", scheme)[0], [r[3] for r in pick("control", scheme)]
        safe = pick("safe", scheme)[0]
        verdict = "lowers" if unsafe[3] < min(ctrl) - 0.02 else "does **not** lower"
        lines.append(f"- **{scheme}**: masking the scanned safety-critical experts {verdict} the harmful refusal rate "
                     f"compared with masking as many random experts in the same layers ({unsafe[3]:.1%} vs "
                     f"{min(ctrl):.1%}–{max(ctrl):.1%}; original {orig:.1%}), at benign KL {unsafe[5]:.2f} nats "
                     f"(random: {min(r[5] for r in pick('control', scheme)):.2f}–"
                     f"{max(r[5] for r in pick('control', scheme)):.2f}); hand-written harmful {unsafe[6]:.1%} "
                     f"against {min(r[6] for r in pick('control', scheme)):.1%}–"
                     f"{max(r[6] for r in pick('control', scheme)):.1%}. Boosting the HRCG experts: harmful refusal "
                     f"{safe[3]:.1%}, benign refusal {safe[4]:.1%}, benign KL {safe[5]:.2f} nats. Degenerate replies: "
                     f"unsafe {unsafe[8]:.1%}, safe {safe[8]:.1%} (original {rows[0][8]:.1%}).")
    verdicts = "\n".join(lines)
    add_safe, rank_safe = pick("safe", "additive")[0], pick("safe", "rank")[0]
    return f"""# Safety steering on the bundled refusing chat model

`python -m scripts.benchmarks.bench_safety` (model `{Path(args.model).name}`; scan on {rep['datasets']['harmful']['samples']}
harmful + {rep['datasets']['benign']['samples']} benign *train* prompts; measured on {len(harmful)} held-out
harmful and {len(benign)} held-out benign template prompts, and on the hand-written ("hw") sets never trained on:
{len(handwritten[0])} harmful, {len(handwritten[1])} benign and lookalike; greedy, 16 tokens,
`mlx_fun.observe.refusal.is_refusal`; "degenerate": replies of all four sets in which a token or a block of up to 4 tokens
repeats 4 times in a row (`mlx_fun.observe.refusal.is_degenerate`); KL(original ‖ steered) of the first reply token on the
benign template prompts). Steering on mlx-fun's hooked MoE call, as `steer` and
`serve` apply it: `additive` adds −1e9 / +1e4 to the router logits; `rank` (SteerMoE) sets a masked expert's logit
to the token's minimum − 0.01 and a boosted one's to its maximum + 0.01. The `unsafe` / `safe` rows are the
report's own modes (`safe`: at most top_k HRCG experts per layer, the most benign-leaning).

| setting | scheme | experts | harmful refusal | benign refusal | hw harmful | hw benign | degenerate | benign KL |
|---|---|---|---|---|---|---|---|---|
{table}

{verdicts}

On this 4-layer, 6M-parameter model the refusal does not hinge on a few experts: the routing-selected
safety-critical experts switch it off no more than as many random ones do. This is reported as measured; the
benchmark was not tuned. For masking, the two schemes choose the same experts (a masked expert is never chosen either
way) and differ only in the softmax's normaliser, which a router that renormalises over its k chosen experts (this
one: qwen3_moe, `norm_topk_prob`) divides out, so the masking rows agree exactly. For boosting they differ in kind:
the additive +1e4 makes a boosted expert take almost all of a softmax router's weight (benign KL {add_safe[5]:.2f}
nats), while rank gives it about the weight of the token's favourite expert (benign KL {rank_safe[5]:.2f} nats).
Either way, boosting the benign-leaning (HRCG) experts on every token *lowers* harmful refusals on this model and
leaves it little coherent to say (the degenerate column): the seed's `safe` mode routes harmful prompts as if they
were benign, so here it makes the model less cautious, not more; the numbers are shown as they came out."""


if __name__ == "__main__":
    sys.exit(main())
