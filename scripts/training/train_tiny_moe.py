#!/usr/bin/env python3
"""Train the small MoE language model that ships under ``data/`` (or your own), on offline text.

Uses mlx-lm's own ``qwen3_moe`` model class, so the result is a plain mlx-lm directory. Runs on whatever MLX
backend is present (CPU, Metal, CUDA) and prints tokens/s and the loss curve. Data: the corpus that
``scripts/tools/prepare_dataset.py`` writes (standard-library-only by default: ``code`` and ``prose``), so anyone can
reproduce the model. A Switch-Transformer load-balancing loss (Fedus et al. 2021: E · Σ_e f_e · P_e) keeps
every expert in use, and a small router z-loss keeps router logits tame.

    python -m scripts.tools.prepare_dataset --output runs/corpus
    python -m scripts.training.train_tiny_moe --data runs/corpus --output runs/my-moe --minutes 8

The checkpoint with the lowest validation loss (mean over domains) is saved, with a model card (``README.md``)
and ``training_log.json`` beside the weights.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from mlx_fun.runtime.blas import maybe_reexec

maybe_reexec()  # Linux CPU: a fast BLAS preloaded, as the `mlx-fun` launcher does (before mlx is imported)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten, tree_map  # noqa: E402

from mlx_fun.model import moe_hook  # noqa: E402
from mlx_fun.datasets.corpus import domain_file  # noqa: E402
from mlx_fun.testing.tiny import SPECIAL_TOKENS, tiny_config, train_tokenizer  # noqa: E402

from scripts.lib.router_log import RouterLog, aux_losses, install_router_log  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="Corpus directory from prepare_dataset.py")
    p.add_argument("--domains", default="code,prose", help="Comma-separated domains to train on")
    p.add_argument("--weights", default="1,3", help="Sampling weight per domain (× its token count)")
    p.add_argument("--output", required=True, help="Model directory to write (must not exist or be empty)")
    p.add_argument("--tokenizer", default=None, help="Existing tokenizer dir; default: train a byte-level BPE")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--moe-intermediate", type=int, default=48)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=100_000, help="Upper bound on optimizer steps")
    p.add_argument("--minutes", type=float, default=8.0, help="Stop after this much training time")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--aux-coef", type=float, default=0.003, help="Load-balancing loss coefficient")
    p.add_argument("--z-coef", type=float, default=1e-3, help="Router z-loss coefficient")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-windows", type=int, default=64, help="Validation windows per domain")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------- data
def read_texts(path: Path) -> list[str]:
    return [json.loads(line)["content"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def tokenize(tokenizer, texts: list[str], eos: int) -> np.ndarray:
    ids = []
    for enc in tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.uint16 if max(ids) < 65536 else np.int32)


def windows(tokens: np.ndarray, n: int, seq: int, rng: np.random.Generator) -> np.ndarray:
    starts = rng.integers(0, len(tokens) - seq - 1, size=n)
    return np.stack([tokens[s:s + seq + 1] for s in starts]).astype(np.int32)


def fixed_windows(tokens: np.ndarray, n: int, seq: int) -> np.ndarray:
    n = max(1, min(n, (len(tokens) - 1) // seq))
    return np.stack([tokens[i * seq:i * seq + seq + 1] for i in range(n)]).astype(np.int32)


# ------------------------------------------------------------------------------------------- main
def main(argv=None):
    args = parse_args(argv)
    from tokenizers import Tokenizer
    from mlx_lm.utils import _get_classes

    from mlx_fun.output.model_dir import save_model_dir
    from mlx_fun.core.writer import check_output_path

    check_output_path(args.output, kind="dir", inputs={"--data": args.data}, force=args.force)
    mx.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    domains = args.domains.split(",")
    weights = [float(w) for w in args.weights.split(",")]
    assert len(weights) == len(domains), "--weights needs one number per domain"
    data = Path(args.data)
    from mlx_fun.runtime.blas import blas_status

    print(f"MLX {mx.__version__} on {mx.default_device()}; {blas_status()}", flush=True)

    tok_dir = Path(args.tokenizer) if args.tokenizer else Path(args.output + ".tokenizer")
    if not args.tokenizer:
        t0 = time.time()
        texts = [t for d in domains for t in read_texts(domain_file(data, d, "train"))]
        train_tokenizer(tok_dir, vocab_size=args.vocab_size, texts=texts)
        print(f"trained a {args.vocab_size}-token byte-level BPE in {time.time() - t0:.1f}s", flush=True)
    tokenizer = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    eos = SPECIAL_TOKENS.index("<|endoftext|>")

    train, val = {}, {}
    for d in domains:
        train[d] = tokenize(tokenizer, read_texts(domain_file(data, d, "train")), eos)
        val[d] = fixed_windows(tokenize(tokenizer, read_texts(domain_file(data, d, "validation")), eos),
                               args.eval_windows, args.seq_len)
        chars = sum(len(t) for t in read_texts(domain_file(data, d, "train")))
        print(f"{d}: {len(train[d]):,} train tokens ({chars / len(train[d]):.2f} chars/token), "
              f"{val[d].shape[0]} validation windows", flush=True)
    mix = np.array([w * len(train[d]) for d, w in zip(domains, weights)], dtype=np.float64)
    mix /= mix.sum()

    config = tiny_config(
        "qwen3_moe", vocab_size=vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_intermediate,
        intermediate_size=args.moe_intermediate * args.top_k, head_dim=args.hidden // args.heads,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, tie_word_embeddings=True,
        max_position_embeddings=4096, rope_theta=10000.0,
    )
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    # GPT-2-style init: small normal weights (mlx's defaults are uniform fan-in, fine for Linear; embeddings
    # default to N(0,1), far too large for a tied head)
    model.model.embed_tokens.weight = mx.random.normal(model.model.embed_tokens.weight.shape) * 0.02
    mx.eval(model.parameters())
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    active = n_params - sum(v.size for k, v in tree_flatten(model.parameters()) if "switch_mlp" in k) * (
        1 - args.top_k / args.experts)
    print(f"model: {n_params / 1e6:.2f}M parameters ({active / 1e6:.2f}M active per token), "
          f"{n_params * 4 / 2**20:.1f} MiB in float32", flush=True)

    adapter = install_router_log(model, config)

    def loss_fn(model, batch):
        RouterLog.entries = []
        x, y = batch[:, :-1], batch[:, 1:]
        logits = model(x).astype(mx.float32)
        ce = nn.losses.cross_entropy(logits, y, reduction="mean")
        bal, z = aux_losses(args.experts)
        return ce + args.aux_coef * bal + args.z_coef * z, (ce, bal)

    def lr_at(step_i: int, elapsed: float) -> float:
        """Linear warm-up, then cosine decay over whichever budget (steps or minutes) runs out first."""
        if step_i < args.warmup:
            return args.lr * (step_i + 1) / args.warmup
        progress = min(1.0, max((step_i - args.warmup) / max(1, args.steps - args.warmup),
                                elapsed / (args.minutes * 60)))
        floor = args.lr * args.min_lr_ratio
        return floor + 0.5 * (args.lr - floor) * (1 + math.cos(math.pi * progress))

    optimizer = optim.AdamW(learning_rate=lr_at(0, 0.0), betas=[0.9, 0.95], weight_decay=args.weight_decay)
    state = [model.state, optimizer.state]

    def step(batch):
        (loss, (ce, bal)), grads = nn.value_and_grad(model, loss_fn)(model, batch)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        return ce, bal

    step = mx.compile(step, inputs=state, outputs=state)

    def evaluate():
        out = {}
        for d in domains:
            tot, n = 0.0, 0
            for i in range(0, val[d].shape[0], args.batch_size):
                b = mx.array(val[d][i:i + args.batch_size])
                RouterLog.entries = []
                logits = model(b[:, :-1]).astype(mx.float32)
                ce = nn.losses.cross_entropy(logits, b[:, 1:], reduction="sum")
                tot += ce.item()
                n += b[:, 1:].size
            out[d] = tot / n
        RouterLog.entries = []
        return out

    log = {"config": {k: v for k, v in vars(args).items()}, "curve": [], "evals": []}
    best = (math.inf, None, None)
    t_start = time.time()
    tokens_seen, window_tokens, window_t = 0, 0, time.time()
    step_i = 0
    while step_i < args.steps and time.time() - t_start < args.minutes * 60:
        counts = rng.multinomial(args.batch_size, mix)
        batch = np.concatenate([windows(train[d], c, args.seq_len, rng) for d, c in zip(domains, counts) if c])
        optimizer.learning_rate = lr_at(step_i, time.time() - t_start)
        ce, bal = step(mx.array(batch))
        mx.eval(state, ce, bal)
        step_i += 1
        tokens_seen += batch.shape[0] * args.seq_len
        window_tokens += batch.shape[0] * args.seq_len
        if step_i % 50 == 0 or step_i == 1:
            tps = window_tokens / (time.time() - window_t)
            window_tokens, window_t = 0, time.time()
            log["curve"].append({"step": step_i, "tokens": tokens_seen, "loss": round(ce.item(), 4),
                                 "balance": round(bal.item(), 4), "tok_s": round(tps)})
            print(f"step {step_i:6d}  tokens {tokens_seen / 1e6:7.2f}M  loss {ce.item():.4f}  "
                  f"balance {bal.item():.3f}  lr {optimizer.learning_rate.item():.2e}  {tps:,.0f} tok/s",
                  flush=True)
        if step_i % args.eval_every == 0:
            losses = evaluate()
            mean = float(np.mean(list(losses.values())))
            log["evals"].append({"step": step_i, "tokens": tokens_seen,
                                 **{f"val_loss_{d}": round(v, 4) for d, v in losses.items()},
                                 **{f"val_ppl_{d}": round(math.exp(v), 2) for d, v in losses.items()}})
            print("  validation: " + "  ".join(f"{d} loss {v:.3f} ppl {math.exp(v):.1f}" for d, v in losses.items()),
                  flush=True)
            if mean < best[0]:
                best = (mean, step_i, tree_map(lambda a: mx.array(a), dict(tree_flatten(model.parameters()))))
                mx.eval(best[2])
            window_t = time.time()
    train_seconds = time.time() - t_start
    losses = evaluate()
    mean = float(np.mean(list(losses.values())))
    if mean < best[0] or best[2] is None:
        best = (mean, step_i, dict(tree_flatten(model.parameters())))
    model.load_weights(list(best[2].items()))
    moe_hook.remove(adapter)
    final = evaluate()
    routing = routing_stats(model, config, val, domains, args)
    log.update({"steps": step_i, "tokens": tokens_seen, "train_seconds": round(train_seconds, 1),
                "best_step": best[1], "final_val_loss": {d: round(v, 4) for d, v in final.items()},
                "final_val_ppl": {d: round(math.exp(v), 2) for d, v in final.items()},
                "routing_max_min_ratio": routing, "parameters": n_params, "device": str(mx.default_device()),
                "mlx": mx.__version__, "python": corpus_python(data), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])})
    print(json.dumps({k: log[k] for k in ("steps", "tokens", "train_seconds", "best_step", "final_val_ppl",
                                          "routing_max_min_ratio")}, indent=1), flush=True)
    config["torch_dtype"] = "float32"
    out = save_model_dir(model, config, args.output, source=tok_dir, force=args.force, inputs={"--data": args.data},
                         metadata={"training_log.json": log, "README.md": model_card(log, config, n_params)})
    print(f"saved {out}", flush=True)


def corpus_python(data: Path) -> str:
    """The Python whose standard library the corpus came from (its manifest), else this interpreter's."""
    try:
        return json.loads((data / "manifest.json").read_text())["python"]
    except (OSError, KeyError, ValueError):
        return sys.version.split()[0]


def routing_stats(model, config, val, domains, args):
    """Per-layer max/min expert selection frequency over the validation windows (all domains)."""
    counts = None
    RouterLog.entries = []
    adapter = install_router_log(model, config)
    for d in domains:
        for i in range(0, val[d].shape[0], args.batch_size):
            RouterLog.entries = []
            model(mx.array(val[d][i:i + args.batch_size, :-1]))
            layer_counts = [np.bincount(np.array(inds).ravel(), minlength=args.experts)
                            for _, _, inds in RouterLog.entries]
            counts = layer_counts if counts is None else [a + b for a, b in zip(counts, layer_counts)]
    moe_hook.remove(adapter)
    RouterLog.entries = []
    return [round(float(c.max() / max(c.min(), 1)), 2) for c in counts]


def model_card(log, config, n_params) -> str:
    a = log["config"]
    evals = "\n".join(
        f"| {e['step']} | {e['tokens'] / 1e6:.1f}M | "
        + " | ".join(f"{e[f'val_ppl_{d}']}" for d in a["domains"].split(",")) + " |"
        for e in log["evals"]
    )
    doms = a["domains"].split(",")
    tok_origin = (f"the tokenizer of {a['tokenizer']}" if a.get("tokenizer")
                  else "trained on the same training text")
    from mlx_fun.datasets.corpus import DESCRIPTIONS

    sources = "; ".join(f"{d}: {DESCRIPTIONS[d].split(' (')[0]}" if d in DESCRIPTIONS else d for d in doms)
    return f"""# mlx-fun tiny MoE ({config['model_type']}, {n_params / 1e6:.1f}M parameters)

A small Mixture-of-Experts language model trained from scratch by `scripts/training/train_tiny_moe.py` for mlx-fun's
demo, tests and quality benchmarks. Plain mlx-lm directory: `mlx_lm.load("<this dir>")` opens it.

- Architecture: {config['model_type']} — hidden {config['hidden_size']}, {config['num_hidden_layers']} layers,
  {config['num_experts']} experts (top-{config['num_experts_per_tok']}, expert width {config['moe_intermediate_size']}),
  {config['num_attention_heads']} attention heads ({config['num_key_value_heads']} KV), tied embeddings, float32.
- Tokenizer: byte-level BPE, {config['vocab_size']} tokens, {tok_origin}.
- Data: `scripts/tools/prepare_dataset.py` — domains {', '.join(doms)}
  ({sources}; Python {log.get('python', '')}),
  train split, sampling weights {a['weights']} × token count. Held-out: the validation split (documents never trained on).
- Training: {log['steps']} steps of {a['batch_size']} × {a['seq_len']} tokens ({log['tokens'] / 1e6:.1f}M tokens) in
  {log['train_seconds'] / 60:.1f} min on {log['device']} (MLX {log['mlx']}); AdamW (β 0.9/0.95, weight decay
  {a['weight_decay']}), lr {a['lr']} with {a['warmup']} warm-up steps and cosine decay (over the step or time budget); Switch load-balancing loss
  × {a['aux_coef']}, router z-loss × {a['z_coef']}; checkpoint with the best validation loss (step {log['best_step']}).
- Held-out perplexity (validation split): {', '.join(f'{d} {p}' for d, p in log['final_val_ppl'].items())}.
- Routing: per-layer max/min expert selection frequency on held-out text: {log['routing_max_min_ratio']}.

Command: `{log['command']}`

## Validation perplexity during training
| step | tokens | {' | '.join(doms)} |
|---|---|{'---|' * len(doms)}
{evals}

Loss curve (training cross-entropy every 50 steps) and tokens/s are in `training_log.json`.
"""


if __name__ == "__main__":
    main()
