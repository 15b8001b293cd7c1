"""The hand-written safety test sets stay held out: no prompt of them is in a training file."""

from __future__ import annotations

import json
from pathlib import Path

SAFETY = Path(__file__).resolve().parents[1] / "data" / "safety"


def _prompts(path: Path) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            msgs = json.loads(line)["messages"]
            out.extend(" ".join(m["content"].lower().split()) for m in msgs if m["role"] == "user")
    return out


def test_hand_written_prompts_are_never_in_a_training_file_and_are_distinct():
    handwritten = {p.stem: _prompts(p) for p in sorted(SAFETY.glob("*_handwritten_test.jsonl"))}
    assert {k: len(v) for k, v in handwritten.items()} == {
        "benign_handwritten_test": 50, "harmful_handwritten_test": 54, "lookalike_handwritten_test": 40}
    every = [p for v in handwritten.values() for p in v]
    assert len(set(every)) == len(every)
    trained = {p for f in SAFETY.glob("*_train.jsonl") for p in _prompts(f)}
    assert trained and not trained & set(every)
