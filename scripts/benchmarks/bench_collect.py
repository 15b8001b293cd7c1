#!/usr/bin/env python3
"""Benchmark `collect`: time with every tap against a plain forward over the same tokens.

    python -m scripts.benchmarks.bench_collect [--bits 4] [--samples 2] [--tokens 256] [--repeats 2] [--blas both]

Model: a random qwen3_moe built in memory (hidden 512, 8 layers, 64 experts, top 8, expert width 256),
4-bit by default. Baselines, measured in the same process on the same samples, one sample per forward:

- ``forward``: ``mx.eval(model(tokens))``, the full logits;
- ``trunk``:   ``mx.eval(model.model(tokens))``, the hidden states without the LM head — the work collect
  really has to do, so the stricter baseline.

With ``--blas both`` (the default on Linux) the measurement runs twice in child processes, once with the
OpenBLAS preload that `mlx-fun` applies and once without (``MLX_FUN_NO_FAST_BLAS=1``), and prints both.
``collect_overhead=<collect time / trunk time>`` of the default configuration is the hooks' own cost, both on
mlx-lm's expert call (target ≤ 1.10). The last line, ``collect_vs_plain_hooks=<ratio>``, is what ``mlx-fun
collect`` really runs — the hooks plus mlx-fun's runtime dispatch (its default) — against those plain hooks
(goal ≥ 3 on this 4-bit model, where the dispatch's dequantized path is 7–16× faster per layer at M ≥ 512).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from scripts.lib.procs import busy_processes, root_env


def measure(args) -> dict:
    import mlx.core as mx

    from mlx_fun.dispatch import experts as dispatch
    from mlx_fun.adapters import get_adapter
    from mlx_fun.runtime.blas import blas_status
    from mlx_fun.observe.collect import collect
    from mlx_fun.testing.tiny import build_model, quantize, tiny_config

    config = tiny_config(
        "qwen3_moe",
        vocab_size=args.vocab,
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_experts=64,
        num_experts_per_tok=8,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    )
    model = build_model(config, seed=0)
    if args.bits:
        model, config = quantize(model, config, bits=args.bits, group_size=64)
    mx.eval(model.parameters())
    adapter = get_adapter(model, config)
    rng = __import__("numpy").random.default_rng(0)
    samples = [rng.integers(0, args.vocab, args.tokens).tolist() for _ in range(args.samples)]

    def time_it(fn) -> float:
        fn()  # warm-up
        best = float("inf")
        for _ in range(args.repeats):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best

    def forward():
        for s in samples:
            mx.eval(model(mx.array([s])))

    def trunk():
        for s in samples:
            mx.eval(model.model(mx.array([s])))

    def run_collect():
        collect(model, adapter, samples, batch_size=1)

    if args.dispatch_only:  # --contended: only what `mlx-fun collect` runs
        dispatch.apply(model, "auto")
        return {"blas": blas_status(), "collect_dispatch_s": time_it(run_collect)}
    t_collect = time_it(run_collect)  # plain hooks on mlx-lm's expert call (`--dispatch mlx-lm`)
    t_trunk = time_it(trunk)
    t_forward = time_it(forward)
    dispatch.apply(model, "auto")  # what `mlx-fun collect` runs by default
    try:
        t_dispatch = time_it(run_collect)
    finally:
        dispatch.remove(model)
    n = args.samples * args.tokens
    return {
        "blas": blas_status(),
        "device": str(mx.default_device()),
        "bits": args.bits or "float",
        "tokens": n,
        "forward_s": t_forward,
        "trunk_s": t_trunk,
        "collect_s": t_collect,
        "collect_tok_s": n / t_collect,
        "collect_dispatch_s": t_dispatch,
        "collect_vs_plain_hooks": t_collect / t_dispatch,
        "overhead_vs_forward": t_collect / t_forward,
        "overhead_vs_trunk": t_collect / t_trunk,
    }


def child(args, fast_blas: bool, extra_env: dict | None = None, dispatch_only: bool = False,
          timeout: float | None = None) -> dict | None:
    """The measurement in a fresh process (with or without the fast BLAS); None when it ran past ``timeout``."""
    env = root_env()
    env.pop("MLX_FUN_BLAS_REEXEC", None)
    if fast_blas:
        env.pop("MLX_FUN_NO_FAST_BLAS", None)
    else:
        env["MLX_FUN_NO_FAST_BLAS"] = "1"
    env.update(extra_env or {})
    cmd = [sys.executable, "-m", __spec__.name, "--blas", "current", "--json",
           "--bits", str(args.bits), "--samples", str(args.samples), "--tokens", str(args.tokens),
           "--repeats", str(args.repeats), "--vocab", str(args.vocab)] + (["--dispatch-only"] if dispatch_only else [])
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=timeout).stdout
    except subprocess.TimeoutExpired:
        return None
    return json.loads(out.strip().splitlines()[-1])


#: --contended: (name, fast BLAS?, environment)
CONFIGS = (("fast BLAS, governed threads (default)", True, {}),
           ("fast BLAS, all threads (before)", True, {"MLX_FUN_BLAS_GOVERNOR": "0"}),
           ("fast BLAS, 1 thread", True, {"OPENBLAS_NUM_THREADS": "1"}),
           ("no fast BLAS", False, {}))


def contended(args) -> int:
    """collect with the dispatch (what `mlx-fun collect` runs) quiet and beside ``--contended`` busy processes,
    for each of :data:`CONFIGS`, each in a fresh process; a run past ``--timeout`` is reported as such."""
    rows = {}
    for label, busy in (("quiet", 0), ("contended", args.contended)):
        with busy_processes(busy, settle=0.3):
            for name, fast, env in CONFIGS:
                r = child(args, fast, env, dispatch_only=True, timeout=args.timeout)
                rows[(label, name)] = None if r is None else r["collect_dispatch_s"]
                shown = "timed out" if r is None else f"{r['collect_dispatch_s']:.2f} s"
                print(f"{label:<9} ({busy} busy) {name:<40} {shown}", flush=True)

    def t(label, name):
        return rows[(label, name)] or float(args.timeout)

    gov, before, none = CONFIGS[0][0], CONFIGS[1][0], CONFIGS[3][0]
    print(f"quiet_collect_s={t('quiet', gov):.2f}")
    print(f"quiet_vs_all_threads={t('quiet', before) / t('quiet', gov):.2f}")
    print(f"contended_collect_s={t('contended', gov):.2f}")
    print(f"contended_vs_all_threads={t('contended', before) / t('contended', gov):.2f}")
    print(f"contended_vs_no_fast_blas={t('contended', none) / t('contended', gov):.2f}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bits", type=int, default=4, help="0 = float weights")
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--blas", choices=("both", "current"), default="both" if sys.platform == "linux" else "current")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dispatch-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--contended", type=int, default=0, metavar="N",
                   help="time collect (with the dispatch) quiet and beside N busy processes, for each BLAS set-up")
    p.add_argument("--timeout", type=float, default=240.0, help="--contended: seconds before a run counts as stuck")
    args = p.parse_args()
    if args.contended:
        return contended(args)

    if args.blas == "current":
        from mlx_fun.runtime.blas import maybe_reexec

        maybe_reexec()
        result = measure(args)
        if args.json or args.dispatch_only:
            print(json.dumps(result))
            return 0
        results = [result]
    else:
        results = [child(args, fast_blas=False), child(args, fast_blas=True)]

    print(f"{'blas':<60} {'forward s':>10} {'trunk s':>9} {'collect s':>10} {'tok/s':>8} {'vs fwd':>7} {'vs trunk':>9} "
          f"{'+dispatch s':>12}")
    for r in results:
        print(f"{r['blas'][:60]:<60} {r['forward_s']:>10.3f} {r['trunk_s']:>9.3f} {r['collect_s']:>10.3f} "
              f"{r['collect_tok_s']:>8.0f} {r['overhead_vs_forward']:>7.3f} {r['overhead_vs_trunk']:>9.3f} "
              f"{r['collect_dispatch_s']:>12.3f}")
    if len(results) == 2:
        print(f"fast_blas_collect_speedup={results[0]['collect_s'] / results[1]['collect_s']:.2f}")
    print(f"collect_overhead={results[-1]['overhead_vs_trunk']:.3f}")
    print(f"collect_vs_plain_hooks={results[-1]['collect_vs_plain_hooks']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
