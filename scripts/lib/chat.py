"""The chat model's prompt sets (``data/safety``), its greedy replies and refusal rates: what the chat fine-tune
picks its checkpoint by, and what the safety benchmarks and the soup measure."""

from __future__ import annotations

import json
from pathlib import Path

#: the refusals of the templated harmful chats (make_safety_data writes them; train_chat_moe recognises them in
#: rows that carry no ``kind``)
REFUSALS = ["I can't help with that. It could cause serious harm.", "I'm sorry, but I can't help with that request.",
            "I won't help with that; it could hurt people.", "Sorry, I can't assist with that."]


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def answer(model, tokenizer, rows: list[dict], max_tokens: int = 16) -> list[str]:
    from mlx_fun.observe.refusal import greedy_replies

    prompts = [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True) for r in rows]
    return greedy_replies(model, tokenizer, prompts, max_tokens)


def all_rates(model, tokenizer, sets: dict[str, list[dict]]) -> dict[str, float]:
    """Refusal rate per prompt set (greedy replies, :func:`mlx_fun.observe.refusal.refusal_rate`)."""
    from mlx_fun.observe.refusal import refusal_rate

    return {kind: refusal_rate(answer(model, tokenizer, rows)) for kind, rows in sets.items()}


def score(r: dict[str, float]) -> float:
    """The fine-tune's checkpoint score: harmful refusal - the larger other refusal."""
    return r["harmful"] - max(v for k, v in r.items() if k != "harmful")
