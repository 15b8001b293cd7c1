#!/usr/bin/env python3
"""KV-cache memory and next-token fidelity of mlx-lm's quantized KV cache (what ``--kv-bits`` turns on in
``smoke-test`` / ``steer`` / ``serve``), against its float cache, at several context lengths.

    python -m scripts.benchmarks.bench_kv [--model data/tiny-moe] [--contexts 1024,4096] [--bits 4,8] [--decode 64]
    python -m scripts.benchmarks.bench_kv --build '{"hidden_size":2048,...}'   # a random qwen3_moe of that shape

For each context length L: a prompt of L tokens (held-out text from the bundled calibration sample, repeated as
needed; with ``--build`` random tokens, since a random model has no text to read) is prefilled into mlx-lm's
``KVCache``; then ``--decode`` further tokens are fed one at a time. The float run is the reference. For each
``--bits`` b the same prefill is converted with mlx-lm's own ``maybe_quantize_kv_cache(..., kv_bits=b,
quantized_kv_start=0)`` (``QuantizedKVCache``, ``--kv-group-size``) and the same tokens decoded against it.
Rows: cache bytes after the prefill (``nbytes`` of every layer's cache), their ratio to float, the mean
KL(float ‖ quantized) of the next-token distributions over the decoded positions (nats), top-1 agreement, and the
decode time per token. The last line is ``kv_bytes_ratio_<b>bit=<bytes / float bytes>`` per b at the longest L.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from scripts.lib.options import add_build
from scripts.lib.paths import CALIBRATION


def _tokens(tokenizer, n: int, vocab: int, random_tokens: bool):
    import numpy as np

    if random_tokens:
        return np.random.default_rng(0).integers(0, vocab, size=n).tolist()
    rows = [json.loads(line) for line in CALIBRATION.open()]
    text = "\n".join(r["content"] for r in rows if isinstance(r.get("content"), str))
    ids = list(tokenizer.encode(text))
    return (ids * (n // max(1, len(ids)) + 1))[:n]


def _run(model, prompt, follow, bits, group_size):
    """(cache bytes, [next-token log-probs per decoded position], seconds per decoded token)."""
    import mlx.core as mx
    from mlx_lm.generate import maybe_quantize_kv_cache
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    step = 2048
    for i in range(0, len(prompt), step):  # prefill in chunks, as mlx-lm's generate_step does
        mx.eval(model(mx.array(prompt[i:i + step])[None], cache=cache))
    maybe_quantize_kv_cache(cache, 0, group_size, bits)
    nbytes = sum(c.nbytes for c in cache)
    out, tic = [], time.perf_counter()
    for t in follow:
        logits = model(mx.array([[t]]), cache=cache)[0, -1].astype(mx.float32)
        out.append(logits - mx.logsumexp(logits))
        mx.eval(out[-1])
    return nbytes, out, (time.perf_counter() - tic) / max(1, len(follow))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="mlx-lm model directory [default: the bundled data/tiny-moe]")
    add_build(ap)
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--kv-group-size", type=int, default=64)
    ap.add_argument("--decode", type=int, default=64, help="Tokens decoded after the prefill (KL positions).")
    ap.add_argument("--dtype", default=None, help="Cast the model's floating weights (e.g. bfloat16).")
    args = ap.parse_args()

    import mlx.core as mx
    from mlx_lm import load

    from mlx_fun.model.io import bundled_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        if args.build:
            from mlx_fun.testing.tiny import make_tiny_model

            args.model = str(make_tiny_model("qwen3_moe", Path(tmp) / "model", **json.loads(args.build)))
        path = args.model or str(bundled_model_dir())
        model, tokenizer = load(path)
    if args.dtype:
        from mlx.utils import tree_map

        dt = getattr(mx, args.dtype)
        model.update(tree_map(lambda a: a.astype(dt) if mx.issubdtype(a.dtype, mx.floating) else a, model.parameters()))
    config = json.loads((Path(path) / "config.json").read_text()) if Path(path).is_dir() else {}
    print(f"device {mx.default_device()}  mlx {mx.__version__}  model {args.model or path}  "
          f"layers {getattr(model, 'layers', None) and len(model.layers)}  context limit "
          f"{config.get('max_position_embeddings', '?')}  group size {args.kv_group_size}")
    contexts = [int(x) for x in args.contexts.split(",")]
    bits = [int(b) for b in args.bits.split(",")]
    print(f"{'context':>8} {'cache':>6} {'bytes':>12} {'ratio':>6} {'KL (nats)':>10} {'top-1':>6} {'ms/token':>9}")
    last = {}
    for L in contexts:
        ids = _tokens(tokenizer, L + args.decode, tokenizer.vocab_size, bool(args.build))
        prompt, follow = ids[:L], ids[L:]
        ref_bytes, ref, ref_t = _run(model, prompt, follow, None, args.kv_group_size)
        print(f"{L:>8} {'float':>6} {ref_bytes:>12,} {1:>6.3f} {0:>10.4f} {1:>6.1%} {ref_t * 1e3:>9.2f}")
        for b in bits:
            try:
                nb, got, t = _run(model, prompt, follow, b, args.kv_group_size)
            except RuntimeError as e:  # MLX's CUDA backend: no quantized matmul for this attention layout
                print(f"{L:>8} {f'{b}-bit':>6} fails: {' '.join(str(e).split())[:150]}")
                continue
            kl = sum(mx.sum(mx.exp(r) * (r - q)).item() for r, q in zip(ref, got)) / len(ref)
            top1 = sum(int(mx.argmax(r).item() == mx.argmax(q).item()) for r, q in zip(ref, got)) / len(ref)
            print(f"{L:>8} {f'{b}-bit':>6} {nb:>12,} {nb / ref_bytes:>6.3f} {kl:>10.4f} {top1:>6.1%} {t * 1e3:>9.2f}")
            last[b] = nb / ref_bytes
    print(" ".join(f"kv_bytes_ratio_{b}bit={r:.3f}" for b, r in last.items()))


if __name__ == "__main__":
    main()
