"""Property-based tests of `mlx-fun serve`'s REST API (hypothesis) against ONE running server on loopback.

Random JSON bodies, numbers (NaN, infinities, huge integers, wrong types), paths and routes, and for every one:
no 5xx; a 4xx is this server's one-line JSON error; a completion whose every value is in range is a 200 (its
stream ends in [DONE]); a rejected (4xx) request leaves /v1/reap/info's token_count and request_count as they
were; and at the end nothing was created or removed outside --data-dir. Examples are derandomized (the same
ones on every run): ``EXAMPLES`` counts the requests (250 in all, by test), printed with their statuses and
asserted at teardown (``pytest -s`` shows the line).
"""

from __future__ import annotations

import http.client
import json
import os
import string
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_fun import jobs
from mlx_fun.io import bundled_model_dir
from mlx_fun.serve.options import ServerOptions

MODEL = bundled_model_dir()
LIMIT = 8  # --max-tokens-limit: completions stay short
MAX_BODY = 16 << 10
EXAMPLES: Counter = Counter()
STATUSES: Counter = Counter()
LAST: dict = {}
#: examples per test (sum: the total quoted in the module docstring's count)
RUNS = {"completions": 110, "reap": 90, "raw": 50}


def _settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=list(HealthCheck))


# ---------------------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The parent of --data-dir (snapshotted), with a sibling directory and a symlink from inside to it."""
    root = tmp_path_factory.mktemp("fuzz")
    (root / "data").mkdir()
    (root / "outside").mkdir()
    (root / "data" / "link").symlink_to(root / "outside", target_is_directory=True)
    (root / "data" / "report.json").write_text(json.dumps({"safety_critical": {"1": [3]},
                                                           "domain_experts": {"2": [4]},
                                                           "general_experts": {"3": [5, 6]}}))
    return root


@pytest.fixture(scope="module")
def server(root):
    s = jobs.serve.start(model=MODEL, server=ServerOptions(port=0, data_dir=root / "data", max_tokens=4,
                                                         max_tokens_limit=LIMIT, max_body_bytes=MAX_BODY,
                                                         prompt_cache_size=2))
    before = _outside(root)
    yield s
    s.stop()
    assert _outside(root) == before, "a request created or removed something outside --data-dir"
    print(f"\nserve fuzz: {sum(EXAMPLES.values())} requests ({dict(EXAMPLES)}), "
          f"statuses {dict(sorted(STATUSES.items()))}")
    assert all(EXAMPLES[k] >= 0.9 * n for k, n in RUNS.items() if EXAMPLES[k]), EXAMPLES


def _outside(root: Path) -> set[str]:
    """Every path under ``root`` except inside data/ (symlinks not followed), plus the neighbourhood of root."""
    found = set()
    for base, dirs, files in os.walk(root):
        rel = os.path.relpath(base, root)
        if rel == "data" or rel.startswith("data" + os.sep):
            continue
        found.update(os.path.join(rel, n) for n in dirs + files)
    return found | {p.name for p in root.parent.iterdir()}


def send(server, method: str, path: str, body=None, raw: bytes | None = None, ctype="application/json"):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, data, {"Content-Type": ctype} if data is not None else {})
    resp = conn.getresponse()
    text = resp.read()
    conn.close()
    return resp.status, text


def totals(server) -> tuple[int, int]:
    status, text = send(server, "GET", "/v1/reap/info")
    assert status == 200, text
    info = json.loads(text)
    assert info["synced"] is True
    return info["token_count"], info["request_count"]


def check(server, method: str, path: str, body=None, raw: bytes | None = None, ctype="application/json", *,
          kind: str) -> int:
    """One request and the properties every answer has; returns the status."""
    EXAMPLES[kind] += 1
    before = LAST.get("totals") or totals(server)  # what the previous request left (nothing else uses the server)
    status, text = send(server, method, path, body, raw, ctype)
    STATUSES[status] += 1
    LAST["totals"] = totals(server)
    assert status < 500, (status, text[:300], body if raw is None else raw[:200])
    if status >= 400:
        err = json.loads(text)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
        assert "\n" not in err["message"] and "Traceback" not in err["message"]
        assert LAST["totals"] == before, (path, body, err)  # rejected: nothing counted
    elif path.split("?")[0].endswith("completions") and status == 200:
        if b"data: " in text[:200] or text.startswith(b": keepalive"):
            assert text.rstrip().endswith(b"data: [DONE]"), text[-200:]
        else:
            assert "usage" in json.loads(text), text[:300]
    return status


# ---------------------------------------------------------------------------------------------- strategies
NUMBERS = st.one_of(st.integers(-2**70, 2**70), st.integers(-3, 20), st.floats(allow_nan=True, allow_infinity=True),
                    st.floats(-2, 2), st.booleans(), st.none(), st.text(max_size=4),
                    st.lists(st.integers(), max_size=2))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**66, 2**66), st.floats(), st.text(max_size=8))
JSON = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids,
                                                                                       max_size=3), max_leaves=8)
NUMERIC_FIELDS = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                  "repetition_penalty", "repetition_context_size", "presence_penalty", "presence_context_size",
                  "frequency_penalty", "frequency_context_size", "xtc_probability", "xtc_threshold",
                  "num_draft_tokens", "top_logprobs"]
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=0, max_size=12)
CONTENT = st.one_of(TEXT, st.none(), st.integers(), st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "x"]), "text": TEXT}), max_size=2))
MESSAGES = st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]),
                                    "content": CONTENT}), min_size=1, max_size=3),
    JSON)


#: in-range values of every number mlx-lm reads (the edges included): valid requests must generate and count
VALID = {"max_tokens": st.integers(1, LIMIT), "max_completion_tokens": st.integers(1, LIMIT),
         "temperature": st.sampled_from([0, 0.0, 1e-300, 0.7, 5]), "top_p": st.sampled_from([1e-9, 0.5, 1]),
         "top_k": st.sampled_from([0, 1, 2047, 2048, 10**9]), "min_p": st.sampled_from([0, 0.5, 1]),
         "seed": st.sampled_from([0, 1, 2**63, 2**64 - 1, None]), "repetition_penalty": st.floats(0, 3),
         "repetition_context_size": st.sampled_from([0, 1, 4096]), "presence_penalty": st.floats(-2, 2),
         "presence_context_size": st.sampled_from([0, 20, 4096]), "frequency_penalty": st.floats(-1e6, 1e6),
         "frequency_context_size": st.sampled_from([0, 4096]), "xtc_probability": st.sampled_from([0, 0.5, 1]),
         "xtc_threshold": st.sampled_from([0, 0.1, 1]), "num_draft_tokens": st.integers(1, 3),
         "top_logprobs": st.sampled_from([-1, 0, 11])}
assert sorted(VALID) == sorted(NUMERIC_FIELDS)
VALID_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(
    TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), min_size=1, max_size=2))}),
    min_size=1, max_size=2)


@st.composite
def completion(draw):
    """A completion body: in range (``valid``: it must be answered 200), or anything in its fields."""
    valid, chat = draw(st.booleans()), draw(st.booleans())
    if valid:
        body = {"messages": draw(VALID_MESSAGES)} if chat else {"prompt": draw(TEXT.filter(bool))}
    else:
        body = {"messages": draw(MESSAGES)} if chat else {"prompt": draw(st.one_of(TEXT, JSON))}
    for key in draw(st.lists(st.sampled_from(NUMERIC_FIELDS), max_size=4, unique=True)):
        body[key] = draw(VALID[key] if valid else NUMBERS)
    extras = {"stream": st.one_of(st.booleans(), SCALARS),
              "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), JSON),
              "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3), JSON),
              "logprobs": st.one_of(st.booleans(), SCALARS),
              "logit_bias": st.one_of(st.dictionaries(st.one_of(st.integers(0, 4000).map(str), TEXT), NUMBERS,
                                                      max_size=3), JSON),
              "model": st.one_of(st.sampled_from(["tiny-moe", "default_model", "../x", str(MODEL)]), SCALARS),
              "chat_template_kwargs": st.one_of(st.dictionaries(st.sampled_from(["enable_thinking", "tokenize",
                                                                                 "return_dict", "x"]), SCALARS,
                                                                max_size=2), JSON),
              "adapters": SCALARS, "tools": JSON, "role_mapping": JSON}
    if valid:
        extras = {"stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
                  "stop": st.one_of(TEXT.filter(bool), st.lists(TEXT, max_size=3)), "logprobs": st.booleans(),
                  "logit_bias": st.dictionaries(st.integers(0, 2047).map(str), st.floats(-100, 100), max_size=3),
                  "model": st.sampled_from(["tiny-moe", "default_model", str(MODEL)])}
    for key in draw(st.lists(st.sampled_from(sorted(extras)), max_size=3, unique=True)):
        body[key] = draw(extras[key])
    if body.get("stream_options") is not None and body.get("stream") is not True and valid:
        body["stream"] = True
    path = "/v1/chat/completions" if chat else draw(st.sampled_from(["/v1/completions", "/v1/completions?x=1"]))
    return valid, path, body


SEGMENT = st.one_of(st.sampled_from(["..", ".", "~", "~nobody", "link", "sub", "", "a" * 300, "report.json"]),
                    st.text(string.ascii_letters + string.digits + "._-~ \\:", min_size=1, max_size=12))


@st.composite
def data_path(draw):
    """Relative and absolute paths, through .., ~, the symlink out, over-long names, odd characters."""
    parts = draw(st.lists(SEGMENT, min_size=1, max_size=4))
    lead = draw(st.sampled_from(["", "", "/", "/tmp/", "~/", "{root}/outside/", "{root}/data/"]))
    suffix = draw(st.sampled_from([".npz", ".npz", ".json", "", ".npz/x.npz"]))
    return lead + "/".join(parts) + suffix


LAYER_MAP = st.one_of(st.dictionaries(st.one_of(st.integers(-1, 5).map(str), TEXT),
                                      st.one_of(st.lists(st.integers(-2, 40), max_size=33), JSON), max_size=3),
                      JSON)


@st.composite
def reap_request(draw, root: Path):
    kind = draw(st.sampled_from(["save", "steer", "steer", "reset", "get", "delete"]))
    fill = lambda p: p.replace("{root}", str(root))  # noqa: E731
    if kind == "save":
        body = {"path": fill(draw(data_path()))} if draw(st.integers(0, 5)) else draw(JSON)
        if isinstance(body, dict) and draw(st.booleans()):
            body["force"] = draw(st.one_of(st.booleans(), SCALARS))
        return "POST", "/v1/reap/save", body
    if kind == "steer":
        body = {}
        for key in draw(st.lists(st.sampled_from(["deactivate", "activate", "scheme", "mode", "safety_map",
                                                  "domain_map", "mask_value", "boost_value", "safety_mode",
                                                  "domain_mode", "extra"]), max_size=4, unique=True)):
            body[key] = draw({"deactivate": LAYER_MAP, "activate": LAYER_MAP,
                              "scheme": st.one_of(st.sampled_from(["additive", "rank"]), SCALARS),
                              "mode": st.one_of(st.sampled_from(["safe", "unsafe", "boost", "suppress"]), SCALARS),
                              "safety_mode": st.sampled_from(["safe", "unsafe", "x"]),
                              "domain_mode": st.sampled_from(["boost", "suppress", "x"]),
                              "safety_map": st.one_of(st.just("report.json"), data_path().map(fill)),
                              "domain_map": st.one_of(st.just("report.json"), data_path().map(fill)),
                              "mask_value": NUMBERS, "boost_value": NUMBERS, "extra": JSON}[key])
        return "POST", "/v1/reap/steer", body
    if kind == "reset":
        return "POST", "/v1/reap/reset", draw(st.one_of(st.just({}), JSON))
    if kind == "get":
        return "GET", draw(st.sampled_from(["/v1/reap/stats", "/v1/reap/info", "/v1/reap/steer", "/v1/models",
                                            "/health", "/v1/reap/nope"])), None
    return "DELETE", draw(st.sampled_from(["/v1/reap/steer", "/v1/reap/stats", "/v1/x"])), None


URL_PATH = st.text(string.ascii_letters + string.digits + "/-._~%?=&", max_size=24).map(lambda p: "/" + p)


# ---------------------------------------------------------------------------------------------- properties
def test_random_completions(server):
    @_settings(RUNS["completions"])
    @given(completion())
    def run(case):
        valid, path, body = case
        status = check(server, "POST", path, raw=json.dumps(body).encode(), kind="completions")
        assert status == 200 or not valid, (status, body)

    run()
    assert EXAMPLES["completions"] >= 0.9 * RUNS["completions"]


def test_random_reap_requests(server, root):
    @_settings(RUNS["reap"])
    @given(reap_request(root))
    def run(case):
        method, path, body = case
        check(server, method, path, raw=None if body is None else json.dumps(body).encode(), kind="reap")

    run()
    call = send(server, "DELETE", "/v1/reap/steer")
    assert call[0] == 200
    assert EXAMPLES["reap"] >= 0.9 * RUNS["reap"]


def test_random_routes_and_raw_bodies(server):
    @_settings(RUNS["raw"])
    @given(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
           st.one_of(URL_PATH, st.sampled_from(["/v1/reap/save", "/v1/reap/steer", "/v1/completions",
                                                "/v1/chat/completions"])),
           st.one_of(st.binary(max_size=64), JSON.map(lambda v: json.dumps(v).encode()),
                     st.integers(1, 40_000).map(lambda n: b'{"deactivate": ' + b"[" * n + b"]" * n + b"}")),
           st.sampled_from(["application/json", "text/plain", ""]))
    def run(method, path, raw, ctype):
        check(server, method, path, raw=raw, ctype=ctype, kind="raw")

    run()
    assert EXAMPLES["raw"] >= 0.9 * RUNS["raw"]
