#!/usr/bin/env python3
"""Fine-tune the bundled MoE into a small chat model that refuses harmful requests and answers benign ones.

    python -m scripts.training.make_safety_data                       # data/safety/*.jsonl (shipped already)
    python -m scripts.training.train_chat_moe --init data/tiny-moe --data data/safety --output tiny-moe-chat --minutes 3

Supervised fine-tuning on ``chat_train.jsonl`` (loss on the assistant turn only, its ``<|im_end|>`` included),
rows sampled by kind (``--harmful-weight``, ``--lookalike-weight`` times their share), with the Switch
load-balancing loss of ``train_tiny_moe.py`` through mlx-fun's hooked MoE call. Every ``--eval-every`` steps the
validation prompts are answered greedily and classified by :func:`mlx_fun.observe.refusal.is_refusal`:
``chat_valid_{harmful,benign,lookalike}.jsonl`` (source items never trained on) where the data has them, else the
template tests. The checkpoint with the best ``harmful refusal − the larger benign refusal`` is saved with its model
card. The hand-written test sets are never read here. Runs on any MLX backend.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mlx_fun.runtime.blas import maybe_reexec

maybe_reexec()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from mlx_fun.model import moe_hook  # noqa: E402

from scripts.lib.chat import REFUSALS, all_rates, read, score  # noqa: E402
from scripts.lib.router_log import RouterLog, aux_losses, install_router_log  # noqa: E402

REFUSAL_SET = set(REFUSALS)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--init", required=True, help="model directory to start from (data/tiny-moe)")
    p.add_argument("--data", required=True, help="directory written by make_safety_data.py")
    p.add_argument("--output", required=True)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-len", type=int, default=160)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--harmful-weight", type=float, default=3.0)
    p.add_argument("--lookalike-weight", type=float, default=1.0)
    p.add_argument("--aux-coef", type=float, default=0.003)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-samples", type=int, default=200, help="held-out prompts per side per evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true")
    return p.parse_args(argv)


def encode(tokenizer, messages: list[dict], max_len: int) -> tuple[list[int], int]:
    """(tokens, number of prompt tokens): the loss covers the rest (the assistant turn)."""
    full = tokenizer.apply_chat_template(messages, tokenize=True)
    prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True)
    return full[:max_len], len(prompt)


def kind_of(row: dict) -> str:
    if "kind" in row:
        return row["kind"]
    return "harmful" if row["messages"][-1]["content"] in REFUSAL_SET else "benign"


def eval_sets(data: Path, rng, n: int) -> dict[str, list[dict]]:
    """Validation prompts per kind: the held-out source items, else the template tests (``n`` at most each)."""
    names = {k: f"chat_valid_{k}" for k in ("harmful", "benign", "lookalike")}
    if not (data / "chat_valid_harmful.jsonl").exists():
        names = {"harmful": "harmful_test", "benign": "benign_test"}
    out = {}
    for kind, name in names.items():
        rows = read(data / f"{name}.jsonl")
        out[kind] = [rows[i] for i in rng.choice(len(rows), min(n, len(rows)), replace=False)]
    return out


def main(argv=None):
    args = parse_args(argv)
    from mlx_lm import load

    from mlx_fun.model.io import read_config
    from mlx_fun.output.model_dir import save_model_dir
    from mlx_fun.core.writer import check_output_path

    check_output_path(args.output, kind="dir", inputs={"--init": args.init, "--data": args.data}, force=args.force)
    mx.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    data = Path(args.data)
    model, tokenizer = load(args.init)
    config = read_config(args.init)
    print(f"MLX {mx.__version__} on {mx.default_device()}", flush=True)
    rows = read(data / "chat_train.jsonl")
    enc = [encode(tokenizer, r["messages"], args.max_len) for r in rows]
    kinds = np.array([kind_of(r) for r in rows])
    harmful = kinds == "harmful"
    p = np.select([harmful, kinds == "lookalike"], [args.harmful_weight, args.lookalike_weight], 1.0)
    p /= p.sum()
    h_test = read(data / "harmful_test.jsonl")
    b_test = read(data / "benign_test.jsonl")
    evals = eval_sets(data, rng, args.eval_samples)
    print(f"{len(rows)} training chats ({harmful.sum()} refusals, {(kinds == 'lookalike').sum()} lookalikes); "
          f"validation {', '.join(f'{len(v)} {k}' for k, v in evals.items())}", flush=True)
    before = all_rates(model, tokenizer, evals)
    print(f"before: refusal {before}", flush=True)

    adapter = install_router_log(model, config)
    E = adapter.num_experts

    def loss_fn(model, x, y, mask):
        RouterLog.entries = []
        logits = model(x).astype(mx.float32)
        ce = (nn.losses.cross_entropy(logits, y, reduction="none") * mask).sum() / mask.sum()
        bal, _ = aux_losses(E)
        return ce + args.aux_coef * bal, ce

    optimizer = optim.AdamW(learning_rate=args.lr, betas=[0.9, 0.95], weight_decay=0.0)
    state = [model.state, optimizer.state]

    def step(x, y, mask):
        (_, ce), grads = nn.value_and_grad(model, loss_fn)(model, x, y, mask)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        return ce

    step = mx.compile(step, inputs=state, outputs=state)

    def batch():
        idx = rng.choice(len(enc), args.batch_size, p=p)
        width = args.max_len  # one shape: mx.compile traces once
        x = np.zeros((len(idx), width), np.int32)
        m = np.zeros((len(idx), width), np.float32)
        for r, i in enumerate(idx):
            toks, n_prompt = enc[i]
            x[r, :len(toks)] = toks
            m[r, n_prompt - 1:len(toks) - 1] = 1.0  # predict the assistant tokens (position t predicts t + 1)
        return mx.array(x[:, :-1]), mx.array(x[:, 1:]), mx.array(m[:, :-1])

    log = {"config": vars(args), "before": before, "curve": [], "evals": []}
    best = (-1.0, None, None)
    t0, i = time.time(), 0
    while i < args.steps and time.time() - t0 < args.minutes * 60:
        ce = step(*batch())
        mx.eval(state, ce)
        i += 1
        if i % 50 == 0:
            log["curve"].append({"step": i, "loss": round(ce.item(), 4)})
            print(f"step {i:5d}  loss {ce.item():.4f}", flush=True)
        if i % args.eval_every == 0:
            moe_hook.remove(adapter)
            r = all_rates(model, tokenizer, evals)
            moe_hook.install(adapter, [RouterLog()])
            log["evals"].append({"step": i, **r})
            print(f"  validation refusal: {', '.join(f'{k} {v:.1%}' for k, v in r.items())}", flush=True)
            if score(r) > best[0]:
                best = (score(r), i, {k: mx.array(v) for k, v in tree_flatten(model.parameters())})
                mx.eval(best[2])
    moe_hook.remove(adapter)
    if best[2] is not None:
        model.load_weights(list(best[2].items()))
    template = all_rates(model, tokenizer, {"harmful": h_test, "benign": b_test})
    log["validation"] = all_rates(model, tokenizer, evals)
    log.update({"steps": i, "best_step": best[1], "train_seconds": round(time.time() - t0, 1),
                "device": str(mx.default_device()), "mlx": mx.__version__,
                "held_out": {"harmful_refusal": template["harmful"], "benign_refusal": template["benign"],
                             "harmful_prompts": len(h_test), "benign_prompts": len(b_test)}})
    print(json.dumps(log["held_out"]), flush=True)
    out = save_model_dir(model, config, args.output, source=args.init, force=args.force,
                         inputs={"--init": args.init, "--data": args.data},
                         metadata={"training_log.json": log, "README.md": model_card(log, args)})
    print(f"saved {out}", flush=True)


def model_card(log: dict, args) -> str:
    held, before = log["held_out"], log["before"]
    valid = ", ".join(f"{k} {v:.1%}" for k, v in log.get("validation", {}).items())
    return f"""# mlx-fun tiny chat MoE (qwen3_moe, refuses harmful requests)

`{args.init}` fine-tuned by `scripts/training/train_chat_moe.py` to answer in chat format: it refuses harmful requests with a
short refusal and answers benign questions (everyday ones, ones that share words with harms, Python functions). It
exists so that safety features (`safety-scan`, `steer`, `abliterate`) can be measured offline; it knows nothing
dangerous: its training data names harms but never describes them. Plain mlx-lm directory; same tokenizer and chat
template as its base.

- Data: `data/safety/` from `scripts/training/make_safety_data.py`: {len(read(Path(args.data) / "chat_train.jsonl"))}
  training chats (harmful sampled ×{args.harmful_weight}, lookalikes ×{args.lookalike_weight}).
- Training: {log["steps"]} steps of {args.batch_size} chats, AdamW lr {args.lr}, loss on the assistant turn only,
  Switch load-balancing loss × {args.aux_coef}; checkpoint picked on the validation prompts: step
  {log["best_step"]} (validation refusal {valid}); {log["train_seconds"]} s on {log["device"]} (MLX {log["mlx"]}).
- Template test sets (greedy, 16 tokens, `mlx_fun.observe.refusal.is_refusal`): harmful **{held["harmful_refusal"]:.1%}**
  of {held["harmful_prompts"]}, benign **{held["benign_refusal"]:.1%}** of {held["benign_prompts"]}. Before
  fine-tuning (validation): {", ".join(f"{k} {v:.1%}" for k, v in before.items())}.
"""



if __name__ == "__main__":
    main()
