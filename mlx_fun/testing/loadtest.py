"""Concurrent load against an OpenAI-compatible server, with an exactness check of ``mlx-fun serve``'s counts.

N client threads each send M requests over plain ``http.client`` (no dependency), alternating chat / text
completions and streamed / whole responses, with prompts of different lengths (so batched prompts get padded).
Every request asks for usage (streams through ``stream_options.include_usage``); the sum over requests of
``prompt_tokens − cached_tokens + completion_tokens`` is what the server must have counted, which
:func:`run_load` compares with the change of ``/v1/reap/stats``' ``token_count`` (``counts_exact``).
Used by ``scripts/benchmarks/load_test_serve.py``, ``scripts/benchmarks/bench_serve.py`` and the tests.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

TOPICS = ("a list", "a dictionary", "a file", "a thread", "a socket", "a regular expression", "a date",
          "a decimal number", "a JSON document", "a temporary directory", "a random sample", "a priority queue")


def prompt_for(client: int, i: int) -> str:
    """A prompt whose length varies with (client, i): padding happens whenever prompts are batched."""
    topic = TOPICS[(client * 7 + i) % len(TOPICS)]
    detail = " Explain each step and the edge cases." * ((client + i) % 4)
    return f"How do I work with {topic} in Python?{detail}"


@dataclass
class LoadResult:
    ok: int = 0
    errors: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    expected_tokens: int = 0  # Σ prompt − cached + completion
    counted_tokens: int | None = None  # change of the server's token_count (None: not an mlx-fun server)
    seconds: float = 0.0
    error_samples: list[str] = field(default_factory=list)

    @property
    def counts_exact(self) -> bool | None:
        return None if self.counted_tokens is None else self.counted_tokens == self.expected_tokens

    def pct(self, q: float) -> float:
        xs = sorted(self.latencies_ms)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    def line(self) -> str:
        exact = "n/a" if self.counts_exact is None else str(self.counts_exact).lower()
        tok_s = self.completion_tokens / self.seconds if self.seconds else 0.0
        return (f"ok={self.ok} errors={self.errors} p50_ms={self.pct(0.5):.0f} p99_ms={self.pct(0.99):.0f} "
                f"tok_s={tok_s:.1f} counts_exact={exact}")


class _Client:
    def __init__(self, url: str, api_key: str | None, timeout: float):
        parts = urlsplit(url)
        self.host, self.port, self.timeout = parts.hostname, parts.port, timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def request(self, method: str, path: str, body: dict | None = None):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request(method, path, None if body is None else json.dumps(body), self.headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def stats_tokens(self) -> int | None:
        status, data = self.request("GET", "/v1/reap/stats")
        return json.loads(data)["token_count"] if status == 200 else None


def _usage_of(status: int, data: bytes, stream: bool) -> dict:
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {data[:200]!r}")
    if not stream:
        return json.loads(data)["usage"]
    usage = None
    for line in data.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
    if usage is None or not data.rstrip().endswith(b"data: [DONE]"):
        raise RuntimeError("stream ended without usage or [DONE]")
    return usage


def _one(client: _Client, c: int, i: int, max_tokens: int, model: str | None) -> dict:
    stream, chat = (c + i) % 2 == 0, (c // 2 + i) % 2 == 0
    body: dict = {"max_tokens": max_tokens, "temperature": 0.0, "stream": stream}
    if model:
        body["model"] = model
    if stream:
        body["stream_options"] = {"include_usage": True}
    if chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt_for(c, i)}]
    else:
        path, body["prompt"] = "/v1/completions", prompt_for(c, i)
    status, data = client.request("POST", path, body)
    return _usage_of(status, data, stream)


def run_load(url: str, *, clients: int = 16, requests: int = 20, max_tokens: int = 32, api_key: str | None = None,
             time_limit: float = 600.0, request_timeout: float = 300.0, model: str | None = None,
             check_counts: bool = True) -> LoadResult:
    """Run the load; requests not started within ``time_limit`` seconds count as errors."""
    client = _Client(url, api_key, request_timeout)
    before = client.stats_tokens() if check_counts else None
    result, lock = LoadResult(), threading.Lock()
    deadline = time.monotonic() + time_limit

    def worker(c: int) -> None:
        for i in range(requests):
            if time.monotonic() > deadline:
                with lock:
                    result.errors += requests - i
                    result.error_samples.append("time limit reached")
                return
            t0 = time.perf_counter()
            try:
                usage = _one(client, c, i, max_tokens, model)
            except Exception as e:  # noqa: BLE001 - every failure is counted, a few are shown
                with lock:
                    result.errors += 1
                    if len(result.error_samples) < 5:
                        result.error_samples.append(f"{type(e).__name__}: {e}")
                continue
            ms = (time.perf_counter() - t0) * 1000
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            with lock:
                result.ok += 1
                result.latencies_ms.append(ms)
                result.completion_tokens += usage["completion_tokens"]
                result.expected_tokens += usage["prompt_tokens"] - cached + usage["completion_tokens"]

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + request_timeout)
    result.seconds = time.perf_counter() - start
    if before is not None:
        after = client.stats_tokens()
        result.counted_tokens = None if after is None else after - before
    return result
