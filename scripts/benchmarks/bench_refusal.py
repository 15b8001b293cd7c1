#!/usr/bin/env python3
"""Refusal rates of a chat model on prompt sets: the template-made test sets and the hand-written ones.

    python -m scripts.benchmarks.bench_refusal [--model data/tiny-moe-chat] [--max-tokens 16] [SET.jsonl ...]

Each set is a JSONL of ``{"messages": [{"role": "user", ...}]}`` prompts (the files of ``data/safety``); the default
sets are the template-made held-out tests and the hand-written ones (``*_handwritten_test.jsonl``: written by hand,
not by ``scripts/training/make_safety_data.py``, never trained on). Replies are greedy, up to ``--max-tokens``
tokens, in the model's chat template, classified by :func:`mlx_fun.observe.refusal.is_refusal`. Prints one line per
set, ``refusal[<set>]=<rate> n=<prompts>``, and with ``--show N`` the first N replies of each set.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scripts.lib.chat import read
from scripts.lib.options import add_model
from scripts.lib.paths import CHAT, SAFETY

SETS = ["harmful_test", "benign_test", "harmful_handwritten_test", "benign_handwritten_test",
        "lookalike_handwritten_test"]


def main() -> int:
    from mlx_fun.runtime.blas import maybe_reexec

    maybe_reexec()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sets", nargs="*", help="prompt files (default: data/safety's test sets, both kinds)")
    add_model(p, default=CHAT)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--show", type=int, default=0, help="print the first N replies of each set")
    args = p.parse_args()
    from mlx_lm import load

    from mlx_fun.observe.refusal import greedy_replies, is_refusal

    model, tok = load(args.model)
    files = [Path(s) for s in args.sets] or [SAFETY / f"{name}.jsonl" for name in SETS]
    for path in files:
        rows = read(path)
        prompts = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True) for r in rows]
        replies = greedy_replies(model, tok, prompts, max_tokens=args.max_tokens)
        refused = [is_refusal(r) for r in replies]
        for row, reply, r in list(zip(rows, replies, refused))[:args.show]:
            print(f"  [{'refused' if r else 'answered'}] {row['messages'][-1]['content'][:70]!r} -> {reply[:70]!r}")
        print(f"refusal[{path.stem}]={sum(refused) / max(1, len(refused)):.3f} n={len(refused)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
