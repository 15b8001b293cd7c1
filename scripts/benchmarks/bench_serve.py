#!/usr/bin/env python3
"""What counting costs a server: the same load against plain `mlx_lm.server` and `mlx-fun serve`, in one run.

    python -m scripts.benchmarks.bench_serve [--model data/tiny-moe] [--clients 16] [--requests 20]
                                             [--max-tokens 32] [--rounds 2]

Each round starts, one after the other, `python -m mlx_lm server`, `mlx-fun serve --mode lightweight` and
`mlx-fun serve --mode full` as child processes on free loopback ports (same model, same mlx-lm batching defaults,
the same fast BLAS: the script re-execs itself with it first, and the children inherit it), warms each up, runs
the load of `scripts/benchmarks/load_test_serve.py` (N clients × M requests, greedy, so every server generates the same
tokens) and stops it. Throughput is completion tokens per second over all rounds. The last lines are

    serve_overhead=<mlx-fun lightweight tok/s ÷ mlx-lm tok/s> mode=lightweight
    serve_overhead=<mlx-fun full tok/s ÷ mlx-lm tok/s> mode=full

(goals on the 2-core CPU: ≥ 0.95 lightweight, ≥ 0.85 full), each mlx-fun run also checking counts_exact.
`--dispatch mlx-lm` runs mlx-fun serve on mlx-lm's own expert call, so the ratio is the counting hooks alone.

`--contended N`: the same load on `mlx_lm.server` as a user starts it (no preloaded BLAS) and on `mlx-fun serve
--mode lightweight` (its fast BLAS, governed threads: mlx_fun.runtime.blas_threads), quiet and then beside N busy processes
(started for the round and stopped at its end); the last lines are ``quiet_vs_mlx_lm=<ratio>`` and
``contended_vs_mlx_lm=<ratio>`` (goal ≥ 1.0 under contention).
"""

from __future__ import annotations

import argparse
import sys

from scripts.lib.options import add_load, add_model
from scripts.lib.procs import busy_processes
from scripts.lib.servers import free_port, running, server_command


def one(kind: str, args, env: dict | None = None) -> tuple[int, float, bool | None]:
    from mlx_fun.testing.loadtest import run_load

    port = free_port()
    cmd = server_command(kind, args.model, port, "--mode", kind, "--dispatch", args.dispatch)
    with running(cmd, port, env):
        url = f"http://127.0.0.1:{port}"
        run_load(url, clients=2, requests=2, max_tokens=8, check_counts=False)  # warm-up (graphs, caches)
        r = run_load(url, clients=args.clients, requests=args.requests, max_tokens=args.max_tokens,
                     check_counts=kind != "mlx-lm", time_limit=args.time_limit)
        if r.errors:
            raise RuntimeError(f"{kind}: {r.errors} errors: {r.error_samples}")
        print(f"{kind:<12} {r.line()} seconds={r.seconds:.1f}", flush=True)
        return r.completion_tokens, r.seconds, r.counts_exact


def contended(args) -> int:
    """mlx_lm.server as a user starts it against mlx-fun serve, quiet and beside ``--contended`` busy processes."""
    import os

    plain = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # mlx_lm.server as installed
    rate = {}
    for phase, busy in (("quiet", 0), ("contended", args.contended)):
        with busy_processes(busy):
            for kind, env in (("mlx-lm", plain), ("lightweight", None)):
                tokens, seconds = 0, 0.0
                for _ in range(args.rounds):
                    t, s, ok = one(kind, args, env)
                    if ok is False:
                        raise RuntimeError(f"{kind}: counts are not exact")
                    tokens, seconds = tokens + t, seconds + s
                rate[(phase, kind)] = tokens / seconds
                print(f"{phase:<9} ({busy} busy) {kind:<12} {rate[(phase, kind)]:.1f} tok/s", flush=True)
    for phase in ("quiet", "contended"):
        print(f"{phase}_vs_mlx_lm={rate[(phase, 'lightweight')] / rate[(phase, 'mlx-lm')]:.2f}")
    return 0


def main() -> int:
    from mlx_fun.runtime.blas import maybe_reexec

    maybe_reexec()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model(ap)
    add_load(ap, clients=16, requests=20, max_tokens=32, time_limit=600.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dispatch", choices=["auto", "mlx-lm"], default="auto",
                    help="mlx-fun's expert dispatch (its default) or mlx-lm's: the latter isolates counting's cost")
    ap.add_argument("--contended", type=int, default=0, metavar="N",
                    help="mlx_lm.server (as installed) vs mlx-fun serve, quiet and beside N busy processes")
    args = ap.parse_args()
    from mlx_fun.runtime.blas import blas_status

    print(blas_status(), flush=True)
    if args.contended:
        return contended(args)
    kinds = ("mlx-lm", "lightweight", "full")
    totals = {k: [0, 0.0] for k in kinds}
    exact = True
    for _ in range(args.rounds):
        for kind in kinds:
            tokens, seconds, ok = one(kind, args)
            totals[kind][0] += tokens
            totals[kind][1] += seconds
            exact = exact and ok is not False
    rate = {k: t / s for k, (t, s) in totals.items()}
    for k in kinds:
        print(f"tok_s[{k}]={rate[k]:.1f}")
    print(f"counts_exact={str(exact).lower()}")
    for mode in ("lightweight", "full"):
        print(f"serve_overhead={rate[mode] / rate['mlx-lm']:.3f} mode={mode}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
