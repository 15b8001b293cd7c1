#!/usr/bin/env python3
"""What hostile and heavy clients can do to a server: `mlx-fun serve` beside plain `mlx_lm.server`, in one run.

    python -m scripts.benchmarks.bench_hostile_serve [--model data/tiny-moe] [--idle 400] [--clients 24]
                                                     [--requests 4] [--prompt-kb 62] [--prompt-wait 30]

Each server is started as a child process on a free loopback port (defaults of both: mlx-fun serve's
--max-connections 64 and --request-timeout 30), then, in turn:

1. **idle**: ``--idle`` connections each send half of a request's headers and wait; the server's threads
   (/proc/<pid>/status) are sampled for 2 s; then one ordinary completion is timed while they are held;
2. **burst**: ``--clients`` × ``--requests`` concurrent completions (``mlx_fun.testing.loadtest.run_load``); the
   requests answered with a connection reset or refusal are counted;
3. **long prompt**: one ``/v1/completions`` whose prompt is ``--prompt-kb`` kB of text (many times the bundled
   model's context), waited for at most ``--prompt-wait`` s: its status and time.

One line per server and step, then the ratios ``idle_threads_vs_mlx_lm`` and ``burst_resets`` of each. Loopback only,
every loop bounded in count and time; the children are stopped at the end.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import sys
import time

from scripts.lib.options import add_load, add_model
from scripts.lib.servers import free_port, running, server_command


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def complete(port: int, prompt: str, timeout: float) -> tuple[str, float]:
    """``(status or error name, seconds)`` of one greedy completion of 2 tokens."""
    start = time.perf_counter()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 2, "temperature": 0}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        conn.close()
        return str(resp.status), time.perf_counter() - start
    except OSError as e:
        return type(e).__name__, time.perf_counter() - start


def idle(port: int, pid: int, n: int) -> tuple[int, int, str, float]:
    """Threads before, the most seen while ``n`` half-sent requests are held, and an ordinary request meanwhile."""
    before = threads(pid)
    socks = []
    try:
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            socks.append(s)
        peak, end = before, time.time() + 2
        while time.time() < end:
            peak = max(peak, threads(pid))
            time.sleep(0.05)
        status, seconds = complete(port, "def main():", timeout=60)
        return before, peak, status, seconds
    finally:
        for s in socks:
            s.close()


def one(kind: str, args) -> dict:
    from mlx_fun.testing.loadtest import run_load

    port = free_port()
    with running(server_command(kind, args.model, port), port) as proc:
        complete(port, "warm up", timeout=60)
        before, peak, status, seconds = idle(port, proc.pid, args.idle)
        print(f"{kind:<8} idle: {args.idle} half-sent requests took the server from {before} to {peak} threads; an "
              f"ordinary request meanwhile: {status} in {seconds:.2f} s", flush=True)
        time.sleep(1)
        r = run_load(f"http://127.0.0.1:{port}", clients=args.clients, requests=args.requests, max_tokens=4,
                     check_counts=False, time_limit=300, request_timeout=120)
        resets = sum("reset" in e.lower() or "refused" in e.lower() for e in r.error_samples)
        print(f"{kind:<8} burst: {args.clients} x {args.requests}: ok={r.ok} errors={r.errors} (resets or refusals "
              f"among the first {len(r.error_samples)} errors: {resets})", flush=True)
        prompt = ("import os\nprint(os.getcwd())\n" * (args.prompt_kb * 1024 // 30 + 1))[: args.prompt_kb * 1024]
        status, seconds = complete(port, prompt, timeout=args.prompt_wait)
        print(f"{kind:<8} long prompt: {len(prompt)} bytes: {status} after {seconds:.1f} s", flush=True)
        return {"threads": peak - before, "errors": r.errors, "prompt": (status, seconds)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model(ap)
    ap.add_argument("--idle", type=int, default=400)
    add_load(ap, clients=24, requests=4)
    ap.add_argument("--prompt-kb", type=int, default=62)
    ap.add_argument("--prompt-wait", type=float, default=30.0)
    args = ap.parse_args()
    got = {kind: one(kind, args) for kind in ("mlx-lm", "mlx-fun")}
    base, ours = got["mlx-lm"], got["mlx-fun"]
    print(f"idle_threads mlx-fun={ours['threads']} mlx-lm={base['threads']} "
          f"ratio={ours['threads'] / max(base['threads'], 1):.3f}")
    print(f"burst_errors mlx-fun={ours['errors']} mlx-lm={base['errors']} of {args.clients * args.requests}")
    print(f"long_prompt mlx-fun={ours['prompt'][0]}/{ours['prompt'][1]:.1f}s "
          f"mlx-lm={base['prompt'][0]}/{base['prompt'][1]:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
