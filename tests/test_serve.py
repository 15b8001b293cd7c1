"""`mlx-fun serve` over real loopback HTTP: the openai client, raw HTTP, exact counts, save → prune, steering,
reset, every bad input's status and JSON body, concurrency. The server runs in this process on a free port."""

from __future__ import annotations

import http.client
import json
import os
from pathlib import Path

import numpy as np
import pytest

from mlx_fun import jobs
from mlx_fun.model.io import bundled_model_dir
from mlx_fun.serve.options import ServerOptions

from .cli_helpers import run as cli

MODEL = bundled_model_dir()
_CONFIG = json.loads((MODEL / "config.json").read_text())
TOP_K, EXPERTS = _CONFIG["num_experts_per_tok"], _CONFIG["num_experts"]
MAX_BODY = 64 << 10


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("serve-data")


@pytest.fixture(scope="module")
def server(data_dir):
    s = jobs.serve.start(model=MODEL, mode="full",
                         server=ServerOptions(port=0, data_dir=data_dir, max_body_bytes=MAX_BODY))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tokenizer():
    from mlx_lm import load

    return load(str(MODEL))[1]


def call(server, method, path, body=None, headers=None, raw: bytes | None = None):
    """(status, parsed JSON or text) of one request over a fresh loopback connection."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    h = {"Content-Type": "application/json", **(headers or {})}
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, data, {k: v for k, v in h.items() if v is not None})
    resp = conn.getresponse()
    text = resp.read()
    conn.close()
    try:
        return resp.status, json.loads(text)
    except ValueError:
        return resp.status, text.decode(errors="replace")


def stats(server):
    status, out = call(server, "GET", "/v1/reap/stats")
    assert status == 200 and out["synced"] is True
    return out


def chat(server, content, max_tokens=8, **extra):
    status, out = call(server, "POST", "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra})
    assert status == 200, out
    return out


def processed(usage) -> int:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return usage["prompt_tokens"] - cached + usage["completion_tokens"]


# ---------------------------------------------------------------------------------------------- OpenAI API
def test_openai_client_chat_stream_and_models(server):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-moe"]
    out = client.chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": "def add(a, b):"}],
                                         max_tokens=6, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens <= 6
    assert out.choices[0].message.role == "assistant" and out.model == "tiny-moe"
    chunks = list(client.chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": "Hello"}],
                                                 max_tokens=6, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens <= 6 and isinstance(text, str)
    comp = client.completions.create(model="tiny-moe", prompt="import os\n", max_tokens=5)
    assert comp.usage.completion_tokens <= 5 and comp.choices[0].text is not None


def test_health_and_raw_text_completion(server):
    assert call(server, "GET", "/health") == (200, {"status": "ok"})
    status, out = call(server, "POST", "/v1/completions", {"prompt": "x = 1\n", "max_tokens": 3})
    assert status == 200 and out["object"] == "text_completion" and out["usage"]["completion_tokens"] <= 3


# ---------------------------------------------------------------------------------------------- counting
def test_counts_equal_processed_tokens(server, tokenizer):
    """After N completions, each layer's freq sum is top_k × the processed-token count, and that count equals
    prompt tokens (from the tokenizer, independently) − cache hits + generated tokens."""
    call(server, "POST", "/v1/reap/reset", {})
    expected = 0
    extras = [{}, {"seed": 3, "temperature": 0.8}, {"stop": ["\n", "e"]}]  # batched, stream_generate, stop words
    for i, content in enumerate(["What is a list?", "Explain os.path.join in detail, please.", "Say hi"]):
        msgs = [{"role": "user", "content": content}]
        out = chat(server, content, max_tokens=5 + i, **extras[i])
        usage = out["usage"]
        assert usage["prompt_tokens"] == len(tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
        if out["choices"][0]["finish_reason"] == "length":
            assert usage["completion_tokens"] == 5 + i
        expected += processed(usage)
    st = stats(server)
    assert st["token_count"] == expected and st["request_count"] == 3
    np.testing.assert_array_equal(np.sum(st["freq"], axis=1), TOP_K * expected)
    np.testing.assert_array_equal(np.sum(st["reap_count"], axis=1), TOP_K * expected)  # full mode: norms too
    assert np.all(np.array(st["ean_sum"]) >= 0) and np.sum(st["ean_sum"]) > 0


def test_prompt_cache_hits_are_not_recounted(server):
    call(server, "POST", "/v1/reap/reset", {})
    content = "Tell me about the json module and how to parse a file with it."
    first = chat(server, content, max_tokens=4)
    second = chat(server, content, max_tokens=4)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0  # mlx-lm served most of the prompt from its cache ...
    assert stats(server)["token_count"] == processed(first["usage"]) + processed(second["usage"])  # ... uncounted


def test_stats_shape_and_scores(server):
    chat(server, "hello", max_tokens=3)
    st = stats(server)
    assert (st["num_layers"], st["num_experts"], st["top_k"], st["model_type"]) == (4, EXPERTS, TOP_K, "qwen3_moe")
    assert np.array(st["freq"]).shape == (4, EXPERTS) and set(st["computed_scores"]) == {"reap", "ean", "freq",
                                                                                    "weighted_freq"}
    np.testing.assert_allclose(st["computed_scores"]["weighted_freq"], st["weighted_freq_sum"])
    assert st["total_samples"] == st["token_count"]


def test_save_then_prune_and_stats_diff(server, data_dir, tmp_path):
    chat(server, "What does itertools.chain do?", max_tokens=6)
    status, out = call(server, "POST", "/v1/reap/save", {"path": "online.npz"})
    assert status == 200 and Path(out["path"]) == data_dir / "online.npz"
    saved = np.load(data_dir / "online.npz")
    assert int(saved["total_tokens"]) == out["token_count"] and str(saved["model_type"]) == "qwen3_moe"
    assert not [p for p in os.listdir(data_dir) if "tmp" in p or p.endswith(".lock")]
    r = cli("prune", "--model", MODEL, "--saliency", data_dir / "online.npz", "--n-prune", 8, "--metric", "freq",
            "--output", tmp_path / "pruned")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "pruned" / "config.json").read_text())["num_experts"] == EXPERTS - 8
    chat(server, "And itertools.islice?", max_tokens=6)
    status, out = call(server, "POST", "/v1/reap/save", {"path": "sub/two.npz"})
    assert status == 200
    r = cli("stats-diff", "--file1", data_dir / "online.npz", "--file2", data_dir / "sub" / "two.npz")
    assert r.exit_code == 0, r.output


def test_reset_zeroes(server):
    chat(server, "hi", max_tokens=2)
    status, out = call(server, "POST", "/v1/reap/reset", {})
    assert status == 200 and out["before"]["token_count"] > 0
    st = stats(server)
    assert st["token_count"] == 0 and st["request_count"] == 0 and np.sum(st["freq"]) == 0


# ---------------------------------------------------------------------------------------------- steering
def _hot_experts(server, layer: int, n: int) -> list[int]:
    call(server, "POST", "/v1/reap/reset", {})
    chat(server, "Write a function that reverses a list.", max_tokens=8)
    return [int(e) for e in np.argsort(stats(server)["freq"][layer])[::-1][:n]]


@pytest.mark.parametrize("scheme", ["additive", "rank"])
def test_steered_off_experts_get_no_counts_until_delete(server, scheme):
    hot = _hot_experts(server, 1, 3)
    status, out = call(server, "POST", "/v1/reap/steer", {"deactivate": {"1": hot}, "scheme": scheme})
    assert status == 200 and out["active"] and out["applied"] and out["steering"]["deactivate"] == {"1": sorted(hot)}
    assert out["steering"]["scheme"] == scheme
    assert call(server, "GET", "/v1/reap/steer")[1]["steering"]["deactivate"] == {"1": sorted(hot)}
    call(server, "POST", "/v1/reap/reset", {})
    chat(server, "Write a function that reverses a list.", max_tokens=8)
    chat(server, "Explain how a dictionary works.", max_tokens=8)
    st = stats(server)
    assert st["token_count"] > 0 and [st["freq"][1][e] for e in hot] == [0, 0, 0]
    np.testing.assert_array_equal(np.sum(st["freq"], axis=1), TOP_K * st["token_count"])
    status, out = call(server, "DELETE", "/v1/reap/steer")
    assert status == 200 and out == {"active": False, "steering": None, "applied": True}
    call(server, "POST", "/v1/reap/reset", {})
    chat(server, "Write a function that reverses a list.", max_tokens=8)
    assert sum(stats(server)["freq"][1][e] for e in hot) > 0


def test_steering_from_reports(server, data_dir):
    hot = _hot_experts(server, 2, 2)
    (data_dir / "safety_report.json").write_text(json.dumps({"hcdg": {"2": hot}}))
    (data_dir / "domain_report.json").write_text(json.dumps({"domain_experts": {"0": [1]},
                                                             "general_experts": {"3": [5, 6]}}))
    status, out = call(server, "POST", "/v1/reap/steer", {"safety_map": "safety_report.json", "mode": "safe",
                                                          "boost_experts": 1})
    assert status == 200 and out["steering"]["activate"] == {"2": [min(hot)]}  # no scores: in expert order
    assert out["steering"]["sources"][0]["boost_experts"] == 1
    status, out = call(server, "POST", "/v1/reap/steer", {"safety_map": "safety_report.json", "mode": "unsafe"})
    assert status == 200 and out["steering"]["deactivate"] == {"2": sorted(hot)}
    call(server, "POST", "/v1/reap/reset", {})
    chat(server, "Write a function that reverses a list.", max_tokens=8)
    assert [stats(server)["freq"][2][e] for e in hot] == [0, 0]
    status, out = call(server, "POST", "/v1/reap/steer", {"domain_map": str(data_dir / "domain_report.json"),
                                                          "mode": "suppress", "activate": {"1": [7]}})
    assert status == 200 and out["steering"]["deactivate"] == {"3": [5, 6]}
    assert out["steering"]["activate"] == {"1": [7]}
    call(server, "POST", "/v1/reap/reset", {})
    chat(server, "hello there", max_tokens=4)
    st = stats(server)
    assert st["freq"][3][5] == st["freq"][3][6] == 0 and st["freq"][1][7] == st["token_count"]  # boosted: always
    assert call(server, "DELETE", "/v1/reap/steer")[0] == 200


# ---------------------------------------------------------------------------------------------- bad input
BAD = [
    ("POST", "/v1/reap/steer", {"deactivate": {"1": [99]}}, 400, "deactivate.1"),
    ("POST", "/v1/reap/steer", {"deactivate": {"9": [1]}}, 400, "deactivate.9"),
    ("POST", "/v1/reap/steer", {"deactivate": [1, 2]}, 400, "deactivate"),
    ("POST", "/v1/reap/steer", {"deactivate": {"0": ["a"]}}, 400, "deactivate.0"),
    ("POST", "/v1/reap/steer", {"deactivate": {"0": list(range(EXPERTS - 2))}}, 400, "deactivate.0"),
    ("POST", "/v1/reap/steer", {"activate": {"0": [1]}, "deactivate": {"0": [1]}}, 400, "activate.0"),
    ("POST", "/v1/reap/steer", {"deactivte": {"0": [1]}}, 400, "deactivte"),
    ("POST", "/v1/reap/steer", {"deactivate": {"0": [1]}, "mask_value": "big"}, 400, "mask_value"),
    ("POST", "/v1/reap/steer", {"deactivate": {"0": [1]}, "scheme": "ranked"}, 400, "scheme"),
    ("POST", "/v1/reap/steer", {"activate": {"0": list(range(1, TOP_K + 2))}, "scheme": "rank"}, 400, "activate.0"),
    ("POST", "/v1/reap/steer", {"safety_map": "safety_report.json", "mode": "sideways"}, 400, "mode"),
    ("POST", "/v1/reap/steer", {"safety_map": "safety_report.json", "mode": "safe", "boost_experts": 0}, 400,
     "boost_experts"),
    ("POST", "/v1/reap/steer", {"safety_map": "safety_report.json", "mode": "safe", "boost_experts": "5"}, 400,
     "boost_experts"),
    ("POST", "/v1/reap/steer", {"safety_map": "missing.json", "mode": "safe"}, 400, "safety_map"),
    ("POST", "/v1/reap/steer", {"safety_map": "../outside.json", "mode": "safe"}, 403, "safety_map"),
    ("POST", "/v1/reap/steer", {"domain_map": "/etc/passwd", "mode": "boost"}, 403, "domain_map"),
    ("POST", "/v1/reap/steer", {}, 400, None),
    ("POST", "/v1/reap/save", {"path": "../escape.npz"}, 403, "path"),
    ("POST", "/v1/reap/save", {"path": "/tmp/escape.npz"}, 403, "path"),
    ("POST", "/v1/reap/save", {"path": "link/escape.npz"}, 403, "path"),
    ("POST", "/v1/reap/save", {"path": "stats.txt"}, 400, "path"),
    ("POST", "/v1/reap/save", {"path": 7}, 400, "path"),
    ("POST", "/v1/reap/save", {}, 400, "path"),
    ("POST", "/v1/reap/nothing", {}, 404, None),
    ("GET", "/v1/reap/nothing", None, 404, None),
    ("DELETE", "/v1/reap/stats", None, 405, None),
    ("PUT", "/v1/reap/steer", {}, 405, None),
    ("POST", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"model": "../../other", "messages": [{"role": "user", "content": "x"}]},
     404, "model"),
    ("POST", "/v1/chat/completions", {"adapters": "/tmp/a", "messages": [{"role": "user", "content": "x"}]},
     400, "adapters"),
    ("POST", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": "x", "stop": [1]}, 400, "stop"),
    ("POST", "/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("POST", "/v1/completions", {"prompt": "x", "stream": True, "stream_options": {}}, 400, "stream_options"),
    # numbers as the CLI checks them (issue 29, rows 5 and 7): NaN, inf, out of range, past --max-tokens-limit
    ("POST", "/v1/completions", {"prompt": "x", "temperature": float("nan")}, 400, "temperature"),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": float("inf")}, 400, "temperature"),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": float("nan")}, 400, "top_p"),
    ("POST", "/v1/completions", {"prompt": "x", "top_k": -1}, 400, "top_k"),
    ("POST", "/v1/completions", {"prompt": "x", "min_p": float("nan")}, 400, "min_p"),
    ("POST", "/v1/completions", {"prompt": "x", "repetition_penalty": float("inf")}, 400, "repetition_penalty"),
    ("POST", "/v1/completions", {"prompt": "x", "presence_penalty": float("-inf")}, 400, "presence_penalty"),
    ("POST", "/v1/completions", {"prompt": "x", "frequency_penalty": 10**400}, 400, "frequency_penalty"),
    ("POST", "/v1/completions", {"prompt": "x", "repetition_context_size": 2**63}, 400, "repetition_context_size"),
    ("POST", "/v1/completions", {"prompt": "x", "xtc_probability": 1.5}, 400, "xtc_probability"),
    ("POST", "/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed"),
    ("POST", "/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1e30}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2**63}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "max_completion_tokens": 4097}, 400, "max_completion_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "logit_bias": {"5": float("nan")}}, 400, "logit_bias"),
    ("POST", "/v1/completions", {"prompt": "x", "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),
    ("POST", "/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url":
                                      {"url": "http://127.0.0.1:9/x.png"}}]}]}, 400, "messages[0].content"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "chat_template_kwargs": {"return_dict": True}}, 400,
     "chat_template_kwargs.return_dict"),
    # paths the filesystem cannot hold (row 6), force that is not a flag (row 2)
    ("POST", "/v1/reap/save", {"path": "a" * 300 + ".npz"}, 400, "path"),
    ("POST", "/v1/reap/save", {"path": "d/" + "b" * 300 + "/s.npz"}, 400, "path"),
    ("POST", "/v1/reap/save", {"path": "s.npz", "force": "yes"}, 400, "force"),
    ("POST", "/v1/reap/steer", {"safety_map": "c" * 300 + ".json", "mode": "safe"}, 400, "safety_map"),
    ("POST", "/v1/reap/steer", {"deactivate": {"\u00b2": [1]}}, 400, "deactivate"),
    # steering that would do nothing (row 18c): every expert of a layer, or every one not deactivated
    ("POST", "/v1/reap/steer", {"activate": {"1": list(range(EXPERTS))}}, 400, "activate.1"),
    ("POST", "/v1/reap/steer", {"activate": {"2": list(range(2, EXPERTS))}, "deactivate": {"2": [0, 1]}}, 400,
     "activate.2"),
    # steering values that are 0 (or infinite) in float32, the logits' precision (issue 41 row 12)
    ("POST", "/v1/reap/steer", {"deactivate": {"0": [1]}, "mask_value": -1e-300}, 400, "mask_value"),
    ("POST", "/v1/reap/steer", {"activate": {"0": [1]}, "boost_value": 1e-300}, 400, "boost_value"),
    ("POST", "/v1/reap/steer", {"activate": {"0": [1]}, "boost_value": 1e300}, 400, "boost_value"),
]


@pytest.mark.parametrize("method,path,body,status,param", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_inputs_get_json_errors(server, data_dir, tmp_path_factory, method, path, body, status, param):
    (data_dir / "safety_report.json").write_text(json.dumps({"hcdg": {"2": [1]}}))
    outside = tmp_path_factory.mktemp("outside")
    if not (data_dir / "link").exists():
        (data_dir / "link").symlink_to(outside, target_is_directory=True)
    got, out = call(server, method, path, body)
    assert got == status, out
    assert isinstance(out, dict) and set(out["error"]) == {"message", "type", "param", "code"}, out
    assert out["error"]["code"] == status and out["error"]["param"] == param and "\n" not in out["error"]["message"]
    assert "Traceback" not in out["error"]["message"]
    assert not list(outside.iterdir()) and not (data_dir.parent / "escape.npz").exists()


def test_malformed_bodies_and_limits(server):
    for raw, ctype, status in [(b"{not json", "application/json", 400), (b"[1, 2]", "application/json", 400),
                               (b"\xff\xfe", "application/json", 400),
                               (b'{"path": "a.npz"}', "text/plain", 415)]:
        got, out = call(server, "POST", "/v1/reap/save", raw=raw, headers={"Content-Type": ctype})
        assert got == status and out["error"]["code"] == status, out
    got, out = call(server, "POST", "/v1/chat/completions", raw=b"{" + b" " * MAX_BODY + b"}")
    assert got == 413 and "limit" in out["error"]["message"]
    got, out = call(server, "POST", "/v1/completions", raw=b"{oops")
    assert got == 400
    got, out = call(server, "GET", "/v1/reap/info", headers={"Host": "evil.example:80"})
    assert got == 403 and out["error"]["param"] == "Host"
    # still serving after all of it
    assert call(server, "GET", "/health")[0] == 200 and chat(server, "still there?", max_tokens=2)


# ---------------------------------------------------------------------------------------------- concurrency
def test_concurrent_load_is_exact(server):
    from mlx_fun.testing.loadtest import run_load

    call(server, "POST", "/v1/reap/reset", {})
    result = run_load(server.url, clients=4, requests=5, max_tokens=12, time_limit=300)
    assert result.errors == 0 and result.ok == 20, result.error_samples
    assert result.counts_exact, (result.counted_tokens, result.expected_tokens)
    st = stats(server)
    np.testing.assert_array_equal(np.sum(st["freq"], axis=1), TOP_K * st["token_count"])
    assert result.line().endswith("counts_exact=true")


# ---------------------------------------------------------------------------------------------- issue 29
def test_values_mlx_lm_would_die_on_keep_the_server_alive(server):
    """A top_k at or past the vocabulary keeps every token, as the CLI's --top-k does (mlx-lm raised on its
    generation thread: every later request got a 5xx); the server answers both paths afterwards."""
    for path, body in (("/v1/completions", {"prompt": "x", "temperature": 0.5, "top_k": 5000}),
                       ("/v1/completions", {"prompt": "x", "temperature": 0.5, "top_k": 2048, "seed": 1})):
        status, out = call(server, "POST", path, {**body, "max_tokens": 3})
        assert status == 200 and out["usage"]["completion_tokens"] <= 3, out
    assert call(server, "GET", "/health") == (200, {"status": "ok"}) and chat(server, "alive?", max_tokens=2)


def test_deep_bodies_and_long_names_are_400_without_a_traceback(server, data_dir, caplog):
    """Issue 29 row 6: a body nested 30k deep (RecursionError) and a 300-character file name (ENAMETOOLONG)
    were 500s with a traceback in the log; now 400s naming the field, nothing logged, nothing written."""
    before = sorted(os.listdir(data_dir))
    deep = b'{"deactivate": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"  # under MAX_BODY, past the parser's stack
    cases = [("/v1/reap/steer", deep, "deactivate"),
             ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "tools": '
              + b"[" * 50 + b"]" * 50 + b"}", "tools"),
             ("/v1/reap/save", json.dumps({"path": "x" * 300 + ".npz"}).encode(), "path")]
    with caplog.at_level("ERROR"):
        for path, raw, field in cases:
            got, out = call(server, "POST", path, raw=raw)
            assert got == 400 and out["error"]["param"] == field, out
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert sorted(os.listdir(data_dir)) == before


def test_save_never_replaces_without_force(server, data_dir):
    """Issue 29 row 2: POST /v1/reap/save over an existing file is a 400 naming "force": true (the file byte for
    byte as it was); with "force": true it is replaced."""
    import hashlib

    target = data_dir / "kept.npz"
    target.write_bytes(b"statistics of another run")
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    got, out = call(server, "POST", "/v1/reap/save", {"path": "kept.npz"})
    assert got == 400 and out["error"]["param"] == "path", out
    assert "already exists" in out["error"]["message"] and '"force": true' in out["error"]["message"]
    assert hashlib.sha256(target.read_bytes()).hexdigest() == digest
    got, out = call(server, "POST", "/v1/reap/save", {"path": "kept.npz", "force": True})
    assert got == 200 and int(np.load(target)["total_tokens"]) == out["token_count"]
    assert not [p for p in os.listdir(data_dir) if "tmp" in p or p.endswith(".lock")]


def test_two_concurrent_saves_to_one_path(server, data_dir):
    """Issue 29 row 8: of two saves to one path at once, one writes and the other is told that another request
    of this server is saving there (not "another mlx-fun run (pid <the server>)")."""
    import threading

    outcomes = []
    for attempt in range(40):  # both wait for the same flush, then race for the lock; retry if one was too quick
        barrier, results = threading.Barrier(2), []

        def save(name=f"race{attempt}.npz"):
            barrier.wait()
            results.append(call(server, "POST", "/v1/reap/save", {"path": name, "force": True}))

        threads = [threading.Thread(target=save) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        outcomes = sorted(results, key=lambda r: r[0])
        if [r[0] for r in outcomes] == [200, 400]:
            break
    assert [r[0] for r in outcomes] == [200, 400], outcomes
    message = outcomes[1][1]["error"]["message"]
    assert "another request of this server" in message and "pid" not in message, message
    assert outcomes[1][1]["error"]["param"] == "path"
    assert not [p for p in os.listdir(data_dir) if "tmp" in p or p.endswith(".lock")]


def test_info_and_stats_agree_with_every_returned_usage(server):
    """Issue 29 row 9: right after each response (batched, seeded single-sequence, streamed), /v1/reap/info and
    /v1/reap/stats both count exactly the tokens the responses' usage reported (info lagged by the last forward)."""
    call(server, "POST", "/v1/reap/reset", {})
    expected = 0
    for i in range(6):
        body = {"prompt": f"def f{i}(x):" + " return x" * i, "max_tokens": 4 + i}
        if i % 3 == 1:
            body["seed"] = i
        if i % 3 == 2:
            body.update(stream=True, stream_options={"include_usage": True})
        status, out = call(server, "POST", "/v1/completions", body)
        assert status == 200
        if body.get("stream"):
            chunks = [json.loads(ln[6:]) for ln in out.splitlines() if ln.startswith("data: {")]
            usage = chunks[-1]["usage"]
        else:
            usage = out["usage"]
        expected += processed(usage)
        info = call(server, "GET", "/v1/reap/info")[1]
        assert (info["token_count"], info["request_count"]) == (expected, i + 1), (i, info["token_count"], expected)
        assert stats(server)["token_count"] == expected


def _counts_after_disconnect(server, body: dict) -> list[int]:
    """Send ``body`` on a raw socket, wait until it generates, close the socket; token counts at +1 s and +2.5 s."""
    import socket
    import time

    def tokens():
        return call(server, "GET", "/v1/reap/info")[1]["token_count"]

    start = tokens()
    data = json.dumps(body).encode()
    sock = socket.create_connection((server.host, server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    deadline = time.monotonic() + 60
    while tokens() < start + 50 and time.monotonic() < deadline:
        time.sleep(0.05)
    sock.close()
    closed = time.monotonic()
    time.sleep(1.0)
    first = tokens()
    time.sleep(max(0.0, closed + 2.5 - time.monotonic()))
    return [start, first, tokens()]


@pytest.mark.parametrize("stream", [False, True])
def test_generation_stops_when_the_client_goes(server, stream):
    """Issue 29 row 5: a client that disconnects stops its generation within 1 s (the token count stops rising);
    a non-streaming request went on to max_tokens (here 4000, about 10 s on this model) before."""
    body = {"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "stream": stream,
            "logit_bias": {"2": -100}}  # no end-of-sequence token: it would generate all 4000
    start, first, last = _counts_after_disconnect(server, body)
    assert first == last, (start, first, last)
    assert last - start < 4000
    assert chat(server, "still serving?", max_tokens=2)


# ---------------------------------------------------------------------------------------------- issue 41
def test_prompts_over_the_context_are_400_before_any_prefill(server, tokenizer):
    """Issue 41 row 5: a prompt longer than the model's context (max_position_embeddings, 4096 here) was
    prefilled in full (a 62 kB prompt: 2 min, RSS 155 MB → 1.1 GB); now a 400 naming ``prompt`` / ``messages``
    (the chat's templated tokens), nothing counted, answered before a forward runs (the limit itself:
    test_serve_cli.py::test_max_prompt_tokens)."""
    context = _CONFIG["max_position_embeddings"]
    unit = " the"
    per = len(tokenizer.encode(unit * 100)) / 100
    long_text = unit * int(context / per + 50)
    assert len(tokenizer.encode(long_text)) > context
    before = call(server, "GET", "/v1/reap/info")[1]
    for path, body, field in (("/v1/completions", {"prompt": long_text}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]},
                               "messages")):
        got, out = call(server, "POST", path, {**body, "max_tokens": 2})
        assert got == 400 and out["error"]["param"] == field, out
        assert f"limit of {context:,}" in out["error"]["message"] and "--max-prompt-tokens" in out["error"]["message"]
    after = call(server, "GET", "/v1/reap/info")[1]
    assert (after["token_count"], after["request_count"]) == (before["token_count"], before["request_count"])
    assert after["max_prompt_tokens"] == context


@pytest.mark.parametrize("field,bad", [("n", 5), ("n", 0), ("best_of", 3), ("echo", True), ("suffix", "}"),
                                       ("response_format", {"type": "json_object"})])
def test_openai_fields_that_would_be_ignored_are_refused(server, field, bad):
    """Issue 41 row 7: ``n: 5`` got one choice and no error; every OpenAI field mlx-lm does not read but that
    changes the answer is a 400 naming it unless it asks for what is served anyway (n 1, echo false, ...)."""
    before = call(server, "GET", "/v1/reap/info")[1]["request_count"]
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        got, out = call(server, "POST", path, {**body, field: bad, "max_tokens": 2})
        assert got == 400 and out["error"]["param"] == field and field in out["error"]["message"], out
    assert call(server, "GET", "/v1/reap/info")[1]["request_count"] == before
    inert = {"n": 1, "best_of": 1, "echo": False, "suffix": "", "response_format": {"type": "text"}}[field]
    got, out = call(server, "POST", "/v1/completions", {"prompt": "x", field: inert, "max_tokens": 2})
    assert got == 200 and len(out["choices"]) == 1, out


def test_a_symlink_loop_in_the_data_dir_is_400_naming_the_path(server, data_dir, caplog):
    """Issue 41 row 7: a symlink loop inside --data-dir was a 500 with a traceback logged at ERROR (save and the
    report paths); now a 400 naming the field and the path, nothing logged, nothing written."""
    for a, b in (("loop_a", "loop_b"), ("loop_b", "loop_a")):
        if not (data_dir / a).is_symlink():
            (data_dir / a).symlink_to(data_dir / b)
    before = sorted(os.listdir(data_dir))
    with caplog.at_level("ERROR"):
        for path, body, field in (("/v1/reap/save", {"path": "loop_a/x.npz"}, "path"),
                                  ("/v1/reap/save", {"path": "loop_b"}, "path"),
                                  ("/v1/reap/steer", {"safety_map": "loop_a", "mode": "safe"}, "safety_map"),
                                  ("/v1/reap/steer", {"domain_map": "loop_b/r.json", "mode": "boost"}, "domain_map")):
            got, out = call(server, "POST", path, body)
            assert got == 400 and out["error"]["param"] == field, out
            assert "symlink loop" in out["error"]["message"] and repr(body[field]) in out["error"]["message"]
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert sorted(os.listdir(data_dir)) == before


def test_health_with_a_query_needs_no_key(tmp_path):
    """Issue 41 row 7: with --api-key, ``GET /health?x=1`` asked for the key (the guard compared the path with its
    query); every other route still needs it, query or not."""
    s = jobs.serve.start(model=MODEL, server=ServerOptions(port=0, data_dir=tmp_path, api_key="k3y"))
    try:
        for path in ("/health", "/health?x=1", "/health?"):
            assert call(s, "GET", path) == (200, {"status": "ok"}), path
        for path in ("/v1/reap/info?x=/health", "/v1/models?/health"):
            got, out = call(s, "GET", path)
            assert got == 401 and out["error"]["type"] == "authentication_error", (path, out)
    finally:
        s.stop()
