#!/usr/bin/env python3
"""Load test for `mlx-fun serve`: N concurrent clients × M requests against a server this script starts.

    python -m scripts.benchmarks.load_test_serve [--model data/tiny-moe] [--clients 16] [--requests 20]
                                                 [--max-tokens 32] [--mode lightweight|full]
                                                 [--url http://127.0.0.1:8080]

The server is started on a free loopback port in this process (or, with --url, an already running one is used).
Requests alternate chat / text and streamed / whole responses, with prompts of different lengths, and the run is
bounded in time (--time-limit). The last line is

    ok=<n> errors=<n> p50_ms=<..> p99_ms=<..> tok_s=<..> counts_exact=<true|false>

where counts_exact compares the server's token_count change with Σ(prompt − cached + completion) of the usage
the server returned (the definition in the README's serve section).
"""

from __future__ import annotations

import argparse
import sys

from scripts.lib.options import add_load, add_model


def main() -> int:
    from mlx_fun.runtime.blas import maybe_reexec

    maybe_reexec()  # the fast BLAS `mlx-fun` itself runs with
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model(ap)
    add_load(ap, clients=16, requests=20, max_tokens=32, time_limit=600.0)
    ap.add_argument("--mode", choices=["lightweight", "full"], default="lightweight")
    ap.add_argument("--url", default=None, help="use this running mlx-fun serve instead of starting one")
    ap.add_argument("--api-key", default=None)
    args = ap.parse_args()

    from mlx_fun import jobs
    from mlx_fun.testing.loadtest import run_load
    from mlx_fun.serve.options import ServerOptions

    server = None
    url = args.url
    if url is None:
        server = jobs.serve.start(model=args.model, mode=args.mode, server=ServerOptions(port=0, api_key=args.api_key))
        url = server.url
    try:
        result = run_load(url, clients=args.clients, requests=args.requests, max_tokens=args.max_tokens,
                          api_key=args.api_key, time_limit=args.time_limit)
    finally:
        if server is not None:
            server.stop()
    for sample in result.error_samples:
        print(f"error: {sample}", file=sys.stderr)
    print(f"server={url} clients={args.clients} requests={args.requests} max_tokens={args.max_tokens} "
          f"mode={args.mode} seconds={result.seconds:.1f} expected_tokens={result.expected_tokens} "
          f"counted_tokens={result.counted_tokens}")
    print(result.line())
    return 0 if result.errors == 0 and result.counts_exact else 1


if __name__ == "__main__":
    sys.exit(main())
