#!/usr/bin/env python3
"""Benchmark every run path on a Qwen3-30B-A3B-shaped model (meant for an NVIDIA GPU; runs anywhere).

    python -m scripts.benchmarks.bench_gpu [--layers 12] [--samples 16] [--tokens 2048] [--batch-size 4] [--quick]

The model is built in memory with mlx-lm's own ``qwen3_moe`` classes and random weights
(:func:`scripts.lib.models.gpu_shape`): hidden 2048, 32 query / 4 KV heads of 128, 128 experts top-8 of width 768,
``--layers`` decoder layers, vocabulary 151,936, bfloat16, quantized by mlx-lm's ``quantize_model`` to 4-bit affine
(group 64) like the mlx-community 4-bit checkpoints.
The random router spreads tokens over the experts and activations stay finite (checked).

Printed, in one run, on the same random samples (``--samples`` × ``--tokens`` tokens):

- ``collect``: tok/s of mlx-fun's collect (runtime dispatch, the default) vs the same hooks on mlx-lm's
  expert call (``--dispatch mlx-lm``) vs a plain trunk forward ``model.model(x)`` without hooks, one sample per
  forward. The freq counts of both collects must be equal and their REAP scores close (checked).
- ``eval``: tok/s with the dispatch (``auto``) vs mlx-lm's expert call, and both mean NLLs.
- ``largest batch``: collect at ``--batch-size`` 1, 2, 4, 8, 16 with the token budget raised to the whole batch
  (one forward of up to 16 × 2,048 tokens: 262,144 routed rows per MoE layer).
- ``merge``: seconds to merge away 32 of 128 experts per layer (8 samples × 1,024 tokens, REAM).
- ``decode``: greedy tok/s of ``smoke-test``'s generation (mlx-fun's sampler, dispatch on) vs plain
  ``mlx_lm.generate`` (``stream_generate`` with its default sampler, mlx-lm's expert call), 256 tokens, best of 3.

The last lines are ``key=value`` ratios: ``collect_vs_plain_hooks`` (goal ≥ 3 on CUDA), ``decode_vs_mlx_lm``
(goal ≥ 0.95), ``largest_batch``.
"""

from __future__ import annotations

import argparse
import sys
import time

from scripts.lib.models import gpu_shape
from scripts.lib.paths import BUNDLED


def timed(fn, repeats: int = 1):
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def set_dispatch(model, on: bool) -> str:
    from mlx_fun.dispatch import experts as dispatch

    dispatch.remove(model)
    return dispatch.apply(model, "auto" if on else "mlx-lm", None, 0).mode


def bench_collect(model, adapter, samples, args, out: dict) -> None:
    import mlx.core as mx
    import numpy as np

    from mlx_fun.model import engine
    from mlx_fun.observe.collect import collect

    n = engine.total_tokens(samples)
    accs = {}
    for name, on in (("ours", True), ("plain_hooks", False)):
        set_dispatch(model, on)
        budget = engine.budget_for(None, top_k=adapter.top_k, dispatched=on)
        collect(model, adapter, samples[:1], batch_size=1, token_budget=budget)  # warm-up
        secs, accs[name] = timed(lambda: collect(model, adapter, samples, batch_size=args.batch_size,
                                                 token_budget=budget))
        out[f"collect_{name}_tok_s"] = n / secs
        print(f"collect {name:<12} {n / secs:>10,.0f} tok/s  ({secs:.2f} s, budget {budget} tokens/forward)",
              flush=True)
    set_dispatch(model, False)

    def trunk():
        for s in samples:
            mx.eval(model.model(mx.array([s])))

    trunk()
    secs, _ = timed(trunk)
    out["trunk_tok_s"] = n / secs
    print(f"trunk forward        {n / secs:>10,.0f} tok/s  ({secs:.2f} s, one sample per forward, no hooks)")
    a, b = accs["ours"], accs["plain_hooks"]
    assert np.array_equal(a.freq, b.freq), "freq counts differ between dispatch and mlx-lm's call"
    reap_a, reap_b = a.scores("reap"), b.scores("reap")
    rel = float(np.abs(reap_a - reap_b).max() / np.abs(reap_b).max())
    out["reap_max_rel_diff"] = rel
    print(f"freq counts equal: yes; REAP max relative difference {rel:.2e}; "
          f"experts never routed: {int((a.freq == 0).sum())} of {a.freq.size}")
    out["accumulator"] = a


def bench_eval(model, adapter, samples, args, out: dict) -> None:
    from mlx_fun.model import engine
    from mlx_fun.observe.evaluate import evaluate

    for name, on in (("auto", True), ("mlx_lm", False)):
        set_dispatch(model, on)
        budget = engine.budget_for(None, top_k=adapter.top_k, dispatched=on)
        evaluate(model, {"w": samples[:1]}, batch_size=1, token_budget=budget)
        secs, res = timed(lambda: evaluate(model, {"w": samples}, batch_size=args.batch_size, token_budget=budget))
        r = res["w"]
        out[f"eval_{name}_tok_s"] = r["tokens"] / secs
        print(f"eval {name:<8} {r['tokens'] / secs:>10,.0f} tok/s  nll {r['nll']:.5f}  ({secs:.2f} s)", flush=True)
    set_dispatch(model, False)


def bench_batches(model, adapter, samples, out: dict) -> None:
    from mlx_fun.observe.collect import collect

    set_dispatch(model, True)
    largest = 0
    for bs in (1, 2, 4, 8, 16):
        if bs > len(samples):
            break
        rows = samples[:bs]
        budget = sum(len(s) for s in rows)
        try:
            secs, acc = timed(lambda: collect(model, adapter, rows, batch_size=bs, token_budget=budget))
        except Exception as e:  # noqa: BLE001 - a benchmark reports what failed and goes on
            print(f"batch {bs:>2} × {len(rows[0])}: FAILED {type(e).__name__}: {str(e)[:120]}")
            break
        largest = bs
        print(f"batch {bs:>2} × {len(rows[0])}: ok, one forward of {budget:,} tokens, {budget / secs:,.0f} tok/s",
              flush=True)
    out["largest_batch"] = largest


def bench_decode(model, args, out: dict) -> None:
    from mlx_lm.generate import stream_generate
    from mlx_lm.utils import load_tokenizer

    from mlx_fun.model.sampling import run_generation

    tokenizer = load_tokenizer(BUNDLED)
    prompt = tokenizer.encode("def fibonacci(n):")

    def ours():  # what `mlx-fun smoke-test` runs: the dispatch installed (its default)
        set_dispatch(model, True)
        return run_generation(model, tokenizer, prompt, max_tokens=args.decode_tokens).generation_tps

    def theirs():  # plain mlx-lm: its SwitchGLU, its sampler
        set_dispatch(model, False)
        last = None
        for last in stream_generate(model, tokenizer, prompt, max_tokens=args.decode_tokens):
            pass
        return last.generation_tps

    ours(), theirs()  # warm-up
    tps = {"ours": 0.0, "mlx_lm": 0.0}
    for _ in range(3):  # interleaved, best of 3: the machine's drift hits both
        tps["ours"] = max(tps["ours"], ours())
        tps["mlx_lm"] = max(tps["mlx_lm"], theirs())
    out.update(decode_ours_tok_s=tps["ours"], decode_mlx_lm_tok_s=tps["mlx_lm"])
    print(f"decode smoke-test {tps['ours']:,.1f} tok/s vs mlx_lm.generate {tps['mlx_lm']:,.1f} tok/s "
          f"({args.decode_tokens} tokens, greedy)")


def bench_merge(model, adapter, samples, args, out: dict) -> None:
    from mlx_fun.rewrite.merge import merge_model
    from mlx_fun.rewrite.merge_options import Ream
    from mlx_fun.experts.selection import Selection
    from mlx_fun.datasets.calibration import Calibration

    set_dispatch(model, True)
    rows = [s[:1024] for s in samples[:8]]
    n_prune, E = adapter.num_experts // 4, adapter.num_experts
    scores = out.pop("accumulator").scores("reap")
    secs, _ = timed(lambda: merge_model(model, adapter, rows, saliency=scores, selection=Selection(n_prune=n_prune),
                                        ream=Ream(saliency_source="file"),
                                        calibration=Calibration(seed=0, batch_size=8)))
    out["merge_s"] = secs
    print(f"merge {n_prune} of {E} experts × {len(adapter.moe_layers())} layers: {secs:.1f} s "
          f"({len(rows)} samples × {len(rows[0])} tokens)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--skip", default="", help="comma-separated parts to skip: collect,eval,batches,decode,merge")
    p.add_argument("--quick", action="store_true", help="small shapes: a check of the script itself")
    args = p.parse_args()
    if args.quick:
        args.layers, args.samples, args.tokens, args.vocab, args.decode_tokens = 2, 4, 128, 4096, 16

    from mlx_fun.runtime.blas import maybe_reexec

    maybe_reexec()
    import mlx.core as mx
    import mlx_lm
    import numpy as np

    t = time.perf_counter()
    model, config, adapter = gpu_shape(layers=args.layers, vocab=args.vocab, quick=args.quick)
    print(f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}, {mx.default_device()}"
          f"{' ' + mx.metal.device_info().get('device_name', '') if mx.metal.is_available() else ''}; "
          f"qwen3_moe hidden {config['hidden_size']}, {adapter.num_experts} experts top-{adapter.top_k}, "
          f"{args.layers} layers, 4-bit affine bf16; built in {time.perf_counter() - t:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    samples = [rng.integers(0, args.vocab, args.tokens).tolist() for _ in range(args.samples)]
    h = model.model(mx.array(samples[:1]))
    assert bool(mx.isfinite(h.astype(mx.float32)).all()), "non-finite activations"
    skip = set(args.skip.split(",")) - {""}
    out: dict = {}
    steps = (("collect", bench_collect, (model, adapter, samples, args, out)),
             ("eval", bench_eval, (model, adapter, samples, args, out)),
             ("batches", bench_batches, (model, adapter, samples, out)),
             ("decode", bench_decode, (model, args, out)),
             ("merge", bench_merge, (model, adapter, samples, args, out)))  # last: it rewrites the model
    for name, fn, fargs in steps:
        if name not in skip and not (name == "merge" and "accumulator" not in out):
            fn(*fargs)
    if "collect_ours_tok_s" in out:
        print(f"collect_vs_plain_hooks={out['collect_ours_tok_s'] / out['collect_plain_hooks_tok_s']:.2f}")
        print(f"collect_vs_trunk={out['collect_ours_tok_s'] / out['trunk_tok_s']:.2f}")
    if "eval_auto_tok_s" in out:
        print(f"eval_auto_vs_mlx_lm={out['eval_auto_tok_s'] / out['eval_mlx_lm_tok_s']:.2f}")
    if "decode_ours_tok_s" in out:
        print(f"decode_vs_mlx_lm={out['decode_ours_tok_s'] / out['decode_mlx_lm_tok_s']:.3f}")
    if "largest_batch" in out:
        print(f"largest_batch={out['largest_batch']}x{args.tokens}")
    if "merge_s" in out:
        print(f"merge_seconds={out['merge_s']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
