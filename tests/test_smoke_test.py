"""Generation with mlx-lm's KV cache and our sampler: parity with mlx_lm.generate, and the `smoke-test` CLI."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

from mlx_fun.cli import main

from mlx_fun.jobs.smoke_test import DEFAULT_PROMPT
from mlx_fun.model.io import load_model
from mlx_fun.model.sampling import GumbelSampler, Sampling, generate_tokens, gumbel_noise, run_generation
from .cli_helpers import expect_error as _error, run  # noqa: E402

N_TOKENS = 24
MODELS = [("qwen3_moe", None), ("qwen3_moe", 4), ("gpt_oss", None), ("gpt_oss", 4)]
STATS = re.compile(r"Prompt: (\d+) tokens, [\d,.]+ tok/s \| Generation: (\d+) tokens, [\d,.]+ tok/s")

_LOADED: dict = {}


@pytest.fixture
def loaded(make_model):
    def get(model_type, bits=None):
        key = (model_type, bits)
        if key not in _LOADED:
            path = make_model(model_type, bits=bits)
            model, tokenizer, _ = load_model(path)
            _LOADED[key] = (path, model, tokenizer)
        return _LOADED[key]

    return get




def _mlx_lm_tokens(model, tokenizer, prompt, max_tokens, **kw) -> list[int]:
    from mlx_lm.generate import stream_generate

    return [int(r.token) for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kw)]


# ----------------------------------------------------------------------------------------------- library parity


@pytest.mark.parametrize("model_type, bits", MODELS)
def test_greedy_matches_mlx_lm_generate(loaded, model_type, bits):
    from mlx_lm.generate import generate
    from mlx_lm.sample_utils import make_sampler as mlx_lm_make_sampler

    _, model, tokenizer = loaded(model_type, bits)
    for prompt in (DEFAULT_PROMPT, "The quick brown fox"):
        ours = generate_tokens(model, tokenizer, prompt, max_tokens=N_TOKENS)
        assert 0 < len(ours) <= N_TOKENS
        assert ours == _mlx_lm_tokens(model, tokenizer, prompt, N_TOKENS)
        assert ours == _mlx_lm_tokens(model, tokenizer, prompt, N_TOKENS, sampler=mlx_lm_make_sampler(temp=0))
        res = run_generation(model, tokenizer, prompt, max_tokens=N_TOKENS,
                             sampling=Sampling(temp=0.0, seed=5, top_k=3, top_p=0.5))
        assert res.tokens == ours  # masks and seed do not change greedy decoding
        assert res.text == generate(model, tokenizer, prompt, max_tokens=N_TOKENS)
        assert res.prompt_tokens == len(tokenizer.encode(prompt)) and res.generation_tps > 0


def test_seeded_sampling_is_gumbel_max_of_mlx_lm_logprobs(loaded):
    """Step n samples argmax(logprobs / T + g(key(seed + n))) from the logprobs mlx-lm's generate_step hands us."""
    from mlx_lm.generate import generate_step

    _, model, tokenizer = loaded("qwen3_moe")
    prompt = mx.array(tokenizer.encode(DEFAULT_PROMPT))
    seed, temp = 11, 1.0
    steps = list(generate_step(prompt, model, max_tokens=N_TOKENS, sampler=GumbelSampler(temp, seed=seed)))
    for n, (token, logprobs) in enumerate(steps):
        g = gumbel_noise((1, logprobs.shape[-1]), mx.random.key(seed + n))
        want = int(np.argmax(np.array(logprobs, dtype=np.float32) / temp + np.array(g)[0]))
        assert int(token) == want, n
    toks = [int(t) for t, _ in steps]
    assert toks == generate_tokens(model, tokenizer, DEFAULT_PROMPT, max_tokens=N_TOKENS,
                                   sampling=Sampling(temp=temp, seed=seed))[
        : len(toks)
    ]


@pytest.mark.parametrize("model_type, bits", [("qwen3_moe", 4), ("gpt_oss", None)])
def test_seeded_generation_is_reproducible(loaded, model_type, bits):
    _, model, tokenizer = loaded(model_type, bits)
    a = generate_tokens(model, tokenizer, DEFAULT_PROMPT, N_TOKENS, Sampling(temp=1.0, seed=3))
    assert a == generate_tokens(model, tokenizer, DEFAULT_PROMPT, N_TOKENS, Sampling(temp=1.0, seed=3))
    assert a != generate_tokens(model, tokenizer, DEFAULT_PROMPT, N_TOKENS, Sampling(temp=1.0, seed=4))
    assert a != generate_tokens(model, tokenizer, DEFAULT_PROMPT, max_tokens=N_TOKENS)  # not greedy
    vocab = model.args.vocab_size if hasattr(model, "args") else 512
    assert all(0 <= t < vocab for t in a)


def test_top_k_one_sampling_is_greedy(loaded):
    _, model, tokenizer = loaded("qwen3_moe")
    greedy = generate_tokens(model, tokenizer, DEFAULT_PROMPT, max_tokens=N_TOKENS)
    assert generate_tokens(model, tokenizer, DEFAULT_PROMPT, N_TOKENS, Sampling(temp=2.0, seed=1, top_k=1)) == greedy


def test_chat_template(loaded):
    _, model, tokenizer = loaded("qwen3_moe")
    res = run_generation(model, tokenizer, "Hello", max_tokens=4, chat=True)
    assert res.prompt_tokens == len(
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                          add_generation_prompt=True),
            add_special_tokens=False,
        )
    )
    assert res.prompt_tokens > len(tokenizer.encode("Hello"))


def test_a_token_budget_bounds_every_prompt_forward_and_keeps_the_tokens(make_model, monkeypatch):
    """``settings.token_budget`` is mlx-lm's ``prefill_step_size``: no forward holds more tokens than the budget,
    and greedy decoding gives the tokens it gives without one."""
    import importlib

    from mlx_fun import jobs
    from mlx_fun.errors import UserError
    from mlx_fun.settings import RunSettings

    path = make_model("qwen3_moe")
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    plain = jobs.smoke_test.run(model=path, prompt=prompt, max_tokens=8)
    Model = importlib.import_module("mlx_lm.models.qwen3_moe").Model
    real, widths = Model.__call__, []

    def counted(self, inputs, *a, **kw):
        widths.append(inputs.shape[-1])
        return real(self, inputs, *a, **kw)

    monkeypatch.setattr(Model, "__call__", counted)
    got = jobs.smoke_test.run(model=path, prompt=prompt, max_tokens=8, settings=RunSettings(token_budget=5))
    assert got.generation.tokens == plain.generation.tokens
    assert got.generation.prompt_tokens > 10 and max(widths) == 5, widths
    with pytest.raises(UserError, match="token_budget= must be a whole number >= 1"):
        jobs.smoke_test.run(model=path, settings=RunSettings(token_budget=0))


# ------------------------------------------------------------------------------------------------------------ CLI


def test_help():
    result = run("--help")
    assert result.exit_code == 0
    assert [ln for ln in result.output.splitlines() if ln.strip().startswith("smoke-test ")]
    result = run("smoke-test", "--help")
    assert result.exit_code == 0
    for flag in ("--model", "--prompt", "--max-tokens", "--temp", "--seed", "--top-k", "--top-p",
                 "--ignore-chat-template", "--system-prompt", "--adapter-path"):
        assert flag in result.output
    assert "def fibonacci(n):" in result.output and "greedy" in result.output


@pytest.mark.parametrize("model_type, bits", [("qwen3_moe", None), ("gpt_oss", 4)])
def test_cli_greedy_prints_mlx_lm_text_and_speeds(loaded, model_type, bits):
    from mlx_lm.generate import generate

    path, model, tokenizer = loaded(model_type, bits)
    result = run("smoke-test", "--model", path, "--max-tokens", N_TOKENS)  # in the chat template, as mlx-lm
    assert result.exit_code == 0, result.output
    text, stats = result.stdout.rsplit("\n", 2)[:2]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": DEFAULT_PROMPT}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer.encode(chat, add_special_tokens=False)
    assert text == generate(model, tokenizer, ids, max_tokens=N_TOKENS)
    m = STATS.fullmatch(stats)
    assert m, stats
    ours = generate_tokens(model, tokenizer, ids, max_tokens=N_TOKENS)
    assert int(m.group(1)) == len(ids) and int(m.group(2)) == len(ours)
    assert "tok/s" in result.output and "greedy" in result.stderr
    raw = run("smoke-test", "--model", path, "--max-tokens", N_TOKENS, "--ignore-chat-template", "--verbose", "F")
    assert raw.exit_code == 0 and raw.stderr == "", raw.output  # --verbose False: the text alone
    assert raw.stdout == generate(model, tokenizer, DEFAULT_PROMPT, max_tokens=N_TOKENS) + "\n"


def test_cli_same_seed_same_output(loaded):
    path, _, _ = loaded("qwen3_moe")
    args = ("smoke-test", "--model", path, "--max-tokens", N_TOKENS, "--temp", 1, "--prompt", "Hello world")
    a = run(*args, "--seed", 7)
    b = run(*args, "--seed", 7)
    c = run(*args, "--seed", 8)
    for r in (a, b, c):
        assert r.exit_code == 0, r.output
    text = lambda r: r.stdout.rsplit("\n", 2)[0]  # noqa: E731
    assert text(a) == text(b) and text(a) != text(c)
    assert "seed=7" in a.stderr
    d = run(*args, "--seed", 7, "--top-k", 5, "--top-p", 0.9, "--min-p", 0.05, "--ignore-chat-template")
    assert d.exit_code == 0 and STATS.search(d.stdout)


def test_cli_missing_model_dir(tmp_path):
    _error(run("smoke-test", "--model", tmp_path / "nope"), "does not exist")


def test_cli_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "definitely_not_a_model"}))
    _error(run("smoke-test", "--model", tmp_path), "definitely_not_a_model", "not supported")


def test_cli_missing_weights(tmp_path, make_model):
    cfg = json.loads((make_model("qwen3_moe") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    result = run("smoke-test", "--model", tmp_path)
    _error(result, str(tmp_path))


@pytest.mark.parametrize("bad", [["--temp", "-1"], ["--top-p", "0"], ["--top-p", "1.5"], ["--top-k", "-2"],
                                 ["--max-tokens", "0"], ["--seed", "-1"]])
def test_cli_rejects_bad_numbers(tmp_path, bad):
    result = run("smoke-test", "--model", tmp_path, *bad)
    assert result.exit_code == 2 and bad[0] in result.output


# ------------------------------------------------------------------------------- mlx_lm.generate's prompt flags
def test_the_prompt_is_built_as_mlx_lm_generate_builds_it(loaded):
    """The chat template with a system prompt, a prefilled reply (continued, no generation prompt) and template
    arguments; the raw text with --ignore-chat-template; what mlx-lm would ignore is one line."""
    from mlx_fun.errors import UserError
    from mlx_fun.model.chat import ChatOptions, prompt_ids

    _, _, tokenizer = loaded("qwen3_moe")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Well,"}]
    want = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True,
                                         add_generation_prompt=False)
    got = prompt_ids(tokenizer, "Hi", ChatOptions(system_prompt="Be brief.", prefill_response="Well,"))
    assert got == tokenizer.encode(want, add_special_tokens=False) and want.endswith("Well,")
    assert prompt_ids(tokenizer, "Hi", ChatOptions(ignore_chat_template=True)) == tokenizer.encode("Hi")
    with pytest.raises(UserError, match="^system_prompt= goes into the chat template, which ignore_chat_template="):
        ChatOptions(system_prompt="x", ignore_chat_template=True)


def test_cli_prompt_flags(loaded):
    path, model, tokenizer = loaded("qwen3_moe")
    first = run("smoke-test", "--model", path, "-m", 4, "--verbose", "False")
    assert first.exit_code == 0, first.output
    greedy = generate_tokens(model, tokenizer, tokenizer.apply_chat_template(
        [{"role": "user", "content": DEFAULT_PROMPT}], tokenize=True, add_generation_prompt=True), max_tokens=4)
    stop = run("smoke-test", "--model", path, "-m", 4, "--extra-eos-token", greedy[0])  # an id, as mlx-lm takes
    assert stop.exit_code == 0 and STATS.search(stop.stdout).group(2) == "1", stop.output
    _error(run("smoke-test", "--model", path, "--extra-eos-token", "<|no-such-token|>"), "--extra-eos-token",
           "not a token of this tokenizer")
    _error(run("smoke-test", "--model", path, "--system-prompt", "x", "--ignore-chat-template"), "--system-prompt",
           "--ignore-chat-template")
    bad = run("smoke-test", "--model", path, "--chat-template-config", "{nope")
    assert bad.exit_code == 2 and "--chat-template-config" in bad.output and "is not JSON" in bad.output
    piped = CliRunner().invoke(main, ["smoke-test", "--model", str(path), "-p", "-", "-m", 2,
                                      "--ignore-chat-template"], input="line one\nline two")
    escaped = run("smoke-test", "--model", path, "-p", "line one\\nline two", "-m", 2, "--ignore-chat-template")
    n = len(tokenizer.encode("line one\nline two"))
    for res in (piped, escaped):  # standard input, and mlx-lm's \n in --prompt: the same two-line prompt
        assert res.exit_code == 0 and int(STATS.search(res.stdout).group(1)) == n, res.output
