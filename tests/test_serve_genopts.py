"""mlx-lm's generation options under `serve` (issue 30 part 2): the quantized / rotating KV cache and speculative
decoding give mlx-lm's tokens, counting stays exact with a draft model (an MoE itself: its forwards are not counted,
nor the drafted tokens the model rejects), bad values are one line before the port opens; the serve entry's mlx-lm
compat check, and a repo id served under its name. One module-scoped server per configuration."""

from __future__ import annotations

import dataclasses
import logging
import signal
import socket

import numpy as np
import pytest

from mlx_fun import jobs
from mlx_fun.errors import UserError
from mlx_fun.model.genopts import GenOptions
from mlx_fun.model.io import bundled_model_dir
from mlx_fun.serve.options import ServerOptions

from .cli_helpers import expect_error
from .cli_helpers import run as cli
from .test_hub import REPO, cached, hf  # noqa: F401 - the fake Hugging Face cache fixtures
from .test_serve import call, processed, stats

MODEL = bundled_model_dir()
K = 3  # num_draft_tokens of the drafted servers: all accepted, a step yields K + 1 tokens
#: no common prefix (no prompt-cache reuse between them); max_tokens % (K + 1) != 0: the draft proposed the last token
PROMPTS = [("def add(a, b):", 10), ("import os\nprint(", 7), ("class Foo:", 13)]
PROMPT = "def read_config(path):"


def _start(port: int = 0, **kw):
    """``jobs.serve.start`` on ``port`` with mlx-lm's generation options given flat, as mlx-lm's
    ``stream_generate`` takes them (the other keywords as they are)."""
    names = {f.name for f in dataclasses.fields(GenOptions)}
    generation = GenOptions(**{k: kw.pop(k) for k in list(kw) if k in names})
    return jobs.serve.start(model=kw.pop("model", MODEL), server=ServerOptions(port=port), generation=generation, **kw)


def _server(**kw):
    server = _start(**kw)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def plain():
    yield from _server()


@pytest.fixture(scope="module")
def drafted():
    """The bundled model with itself (loaded a second time) as the draft model: an MoE draft."""
    yield from _server(draft_model=MODEL, num_draft_tokens=K)


@pytest.fixture(scope="module")
def mlx_lm_model():
    from mlx_lm import load

    return load(str(MODEL))


def complete(server, prompt, max_tokens, **extra) -> dict:
    status, out = call(server, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, **extra})
    assert status == 200, out
    assert out["choices"][0]["finish_reason"] == "length"
    return out


def info(server) -> dict:
    return call(server, "GET", "/v1/reap/info")[1]


# ---------------------------------------------------------------------------------------------- speculative
def test_a_draft_model_keeps_greedy_output_and_the_counts(plain, drafted):
    """Greedy output with the draft is the output without it; the draft (an MoE) adds nothing to the counts: per
    expert they are the plain server's, and the usage's. A response whose last token the model made itself (here
    max_tokens % (K + 1) == 0) never fed that token back: one token less than its usage."""
    texts, usages = {}, {}
    for name, server in (("plain", plain), ("drafted", drafted)):
        call(server, "POST", "/v1/reap/reset", {})
        outs = [complete(server, p, n) for p, n in PROMPTS]
        texts[name] = [o["choices"][0]["text"] for o in outs]
        usages[name] = sum(processed(o["usage"]) for o in outs)
    assert texts["drafted"] == texts["plain"]
    got = {name: stats(server) for name, server in (("plain", plain), ("drafted", drafted))}
    assert got["plain"]["token_count"] == usages["plain"] == got["drafted"]["token_count"] == usages["drafted"]
    np.testing.assert_array_equal(got["drafted"]["freq"], got["plain"]["freq"])
    np.testing.assert_allclose(got["drafted"]["weighted_freq_sum"], got["plain"]["weighted_freq_sum"], rtol=1e-4)
    now = info(drafted)
    assert now["draft_rejected"] == 0 and now["request_count"] == len(PROMPTS)
    assert now["generation"]["draft_model"] == str(MODEL) and now["generation"]["num_draft_tokens"] == K
    again = complete(drafted, PROMPTS[0][0], 2 * (K + 1))  # a prompt-cache hit, the model's own last token
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert info(drafted)["token_count"] == now["token_count"] + processed(again["usage"]) - 1
    assert again["choices"][0]["text"] == complete(plain, PROMPTS[0][0], 2 * (K + 1))["choices"][0]["text"]


@pytest.fixture(scope="module")
def unlike(make_model, qwen_model):
    """A tiny qwen3_moe drafted by a tiny mixtral of the same tokenizer: most drafted tokens are rejected."""
    yield from _server(model=qwen_model, draft_model=make_model("mixtral"), num_draft_tokens=K)


def test_rejected_drafted_tokens_are_not_counted(unlike, qwen_model):
    """Per request, the counts are exactly an offline collect of the tokens the model kept: the prompt and the
    output (its last token unless the draft proposed it), not the drafted tokens it rejected; the output is
    mlx_lm.generate's greedy one."""
    from mlx_lm import load, stream_generate

    from mlx_fun.adapters import get_adapter
    from mlx_fun.observe.collect import collect
    from mlx_fun.model.io import read_config

    model, tok = load(str(qwen_model))
    adapter = get_adapter(model, read_config(qwen_model))
    rejected = 0
    for prompt, n in PROMPTS:
        call(unlike, "POST", "/v1/reap/reset", {})
        out = complete(unlike, prompt, n, logprobs=True)
        ids = tok.encode(prompt)
        tokens = [t["id"] for t in out["choices"][0]["logprobs"]["content"]]
        assert tokens == [r.token for r in stream_generate(model, tok, ids, max_tokens=n)]
        got = stats(unlike)
        assert got["token_count"] in (len(ids) + n - 1, len(ids) + n) and out["usage"]["prompt_tokens"] == len(ids)
        ref = collect(model, adapter, [ids + tokens[: got["token_count"] - len(ids)]], batch_size=1)
        np.testing.assert_array_equal(got["freq"], ref.freq)
        rejected += info(unlike)["draft_rejected"]
    assert rejected > 0  # drafts really were rejected (and then not counted)


def test_request_draft_options(drafted):
    """A body's num_draft_tokens is checked as --num-draft-tokens (a whole number >= 1) and used; a body's
    draft_model is refused (a request may not load files). Refusals are not counted."""
    call(drafted, "POST", "/v1/reap/reset", {})
    for body, field in (({"num_draft_tokens": 0}, "num_draft_tokens"), ({"num_draft_tokens": 1.5}, "num_draft_tokens"),
                        ({"num_draft_tokens": True}, "num_draft_tokens"), ({"draft_model": str(MODEL)}, "draft_model")):
        status, out = call(drafted, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 3, **body})
        assert status == 400 and out["error"]["param"] == field, out
    assert info(drafted)["token_count"] == 0
    outs = [complete(drafted, PROMPT, 7, num_draft_tokens=k) for k in (1, 2)]  # 7 % (k + 1) != 0: as above
    assert outs[0]["choices"][0]["text"] == outs[1]["choices"][0]["text"]
    got = info(drafted)
    assert got["draft_rejected"] == 0 and got["token_count"] == sum(processed(o["usage"]) for o in outs)


# ---------------------------------------------------------------------------------------------- KV cache
@pytest.fixture(scope="module", params=[dict(kv_bits=4, quantized_kv_start=0), dict(max_kv_size=12)],
                ids=["kv-bits", "max-kv-size"])
def kv(request):
    for server in _server(**request.param):
        yield server, request.param


def test_kv_cache_options_give_mlx_lm_s_tokens(kv, mlx_lm_model):
    """Each option changes what mlx-lm generates, and the served text with it (the rotating cache, which
    mlx-lm's server lacks, included); the counts stay the usage's, prompt-cache hits included."""
    from mlx_lm import stream_generate

    server, options = kv
    model, tok = mlx_lm_model
    ids = tok.encode(PROMPT)
    want = "".join(r.text for r in stream_generate(model, tok, ids, max_tokens=24, **options))
    assert want != "".join(r.text for r in stream_generate(model, tok, ids, max_tokens=24))
    call(server, "POST", "/v1/reap/reset", {})
    outs = [complete(server, PROMPT, 24), complete(server, PROMPT + "\n", 24)]
    assert outs[0]["choices"][0]["text"] == want
    assert stats(server)["token_count"] == sum(processed(o["usage"]) for o in outs)
    assert {k: info(server)["generation"][k] for k in options} == options


# ---------------------------------------------------------------------------------------------- refusals
@pytest.fixture
def taken_port():
    """A port this test holds: a server that got as far as binding would fail on it ("cannot listen")."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("kw, needle", [
    (dict(kv_bits=4, max_kv_size=64), "kv_bits= and max_kv_size= do not go together"),
    (dict(max_kv_size=64, draft_model=MODEL), "max_kv_size= does not work with draft_model="),
    (dict(kv_bits=7), "kv_bits= must be one of 2, 3, 4, 5, 6, 8"),
    (dict(num_draft_tokens=0, draft_model=MODEL), "num_draft_tokens= must be a whole number >= 1"),
    (dict(draft_model="/nonexistent/draft"), "draft_model= /nonexistent/draft"),
])
def test_bad_options_are_refused_before_binding(kw, needle, taken_port):
    with pytest.raises(UserError, match=needle):
        _start(taken_port, **kw)


def test_cli_refusals(tmp_path, taken_port, make_model, caplog):
    """One line each, nothing written; the draft's vocabulary is checked once it loads (on mlx-lm's generation
    thread, which logs no traceback for it), named by its flag."""
    out = tmp_path / "online.npz"
    expect_error(cli("serve", "--model", MODEL, "--port", taken_port, "--kv-bits", 4, "--max-kv-size", 8,
                     "--auto-save", out), "--kv-bits and --max-kv-size")
    other = make_model("qwen3_moe")  # the tests' own tokenizer: another vocabulary than the bundled model's
    expect_error(cli("serve", "--model", MODEL, "--port", 0, "--draft-model", other, "--auto-save", out),
                 f"--draft-model {other} has a vocabulary of", "speculative decoding needs the same tokenizer")
    assert list(tmp_path.iterdir()) == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


# ---------------------------------------------------------------------------------------------- compat
def test_a_missing_mlx_lm_name_is_one_line_before_binding(monkeypatch, taken_port):
    import mlx_lm.server

    monkeypatch.delattr(mlx_lm.server.ModelProvider, "_load")  # (only loading calls it: running servers go on)
    with pytest.raises(UserError, match=r"lacks mlx_lm\.server\.ModelProvider\._load, needed by mlx-fun serve; "
                                        r"mlx-fun is tested with mlx-lm"):
        jobs.serve.start(model=MODEL, server=ServerOptions(port=taken_port))
    expect_error(cli("serve", "--model", MODEL, "--port", taken_port), "ModelProvider._load", "mlx-fun serve")


def test_without_the_padding_function_prompts_go_one_at_a_time(monkeypatch):
    """_right_pad_prompts is looked up through mlx_lm_compat; an mlx-lm without it serves (exactly counted)
    with --prompt-concurrency 1, and says so."""
    import importlib

    generate = importlib.import_module("mlx_lm.generate")  # the module (mlx_lm.generate is also a function)
    monkeypatch.delattr(generate, "_right_pad_prompts")
    lines = []
    server = jobs.serve.start(model=MODEL, server=ServerOptions(port=0), log=lines.append)
    try:
        out = complete(server, PROMPT, 3)
        assert stats(server)["token_count"] == processed(out["usage"])
    finally:
        server.stop()
    assert any("--prompt-concurrency 1" in line for line in lines), lines
    assert not hasattr(generate, "_right_pad_prompts")  # not put back by the stop


# ---------------------------------------------------------------------------------------------- model name
def _served_names(model) -> dict:
    """GET /v1/models, a completion's "model" (asked by that name) and /v1/reap/info's model_id of ``model``
    served by the job (stopped by a SIGINT once ready)."""
    seen = {}

    def ready(server):
        try:
            (card,) = call(server, "GET", "/v1/models")[1]["data"]
            seen["models"] = card["id"]
            seen["completion"] = complete(server, "x", 1, model=card["id"])["model"]
            seen["info"] = info(server)["model_id"]
        finally:
            signal.raise_signal(signal.SIGINT)

    jobs.serve.run(model=model, server=ServerOptions(port=0), on_ready=ready)
    return seen


def test_a_repo_id_is_served_under_its_name(cached, qwen_model):  # noqa: F811 - the fixture imported above
    """As mlx_lm.server: a model given as a Hugging Face repo id is served as that id, not its snapshot path; a
    local directory (a snapshot directory too) under its directory's name, as before."""
    from .test_hub import MAIN

    assert _served_names(REPO) == dict.fromkeys(("models", "completion", "info"), REPO)
    assert set(_served_names(qwen_model).values()) == {qwen_model.name}
    snapshot = cached / f"models--{REPO.replace('/', '--')}" / "snapshots" / MAIN
    assert set(_served_names(str(snapshot)).values()) == {MAIN}
