"""mlx-lm's generation options where mlx-fun generates (issue 30 part 2): smoke-test and steer pass the quantized /
rotating KV cache and speculative decoding through to mlx-lm, token for token what mlx_lm.generate gives, and refuse
in one line what mlx-lm would ignore or crash on."""

from __future__ import annotations

import json

import pytest

from mlx_fun import jobs
from mlx_fun.errors import UserError
from mlx_fun.model.genopts import GenOptions
from mlx_fun.model.io import bundled_model_dir
from mlx_fun.jobs.steer import SteerOptions

from .cli_helpers import expect_error, run

MODEL = bundled_model_dir()
PROMPT = "def read_config(path):"


@pytest.fixture(scope="module")
def mlx_lm_model():
    from mlx_lm import load

    return load(str(MODEL))


def _mlx_lm_text(mlx_lm_model, **kw) -> str:
    from mlx_lm import stream_generate

    model, tok = mlx_lm_model
    return "".join(r.text for r in stream_generate(model, tok, PROMPT, max_tokens=24, **kw))


@pytest.mark.parametrize("flags, kw", [
    (("--kv-bits", 4, "--quantized-kv-start", 0), dict(kv_bits=4, quantized_kv_start=0)),
    (("--kv-bits", 2, "--kv-group-size", 32, "--quantized-kv-start", 4), dict(kv_bits=2, kv_group_size=32,
                                                                              quantized_kv_start=4)),
    (("--max-kv-size", 12), dict(max_kv_size=12)),
])
def test_kv_cache_options_give_mlx_lm_s_tokens(flags, kw, mlx_lm_model):
    got = run("smoke-test", "--model", MODEL, "--prompt", PROMPT, "--max-tokens", 24, "--dispatch", "mlx-lm",
              "--ignore-chat-template", *flags)  # the base model continues code
    assert got.exit_code == 0, got.output
    text = _mlx_lm_text(mlx_lm_model, **kw)
    assert f"Sampler: GumbelSampler(greedy)\n{text}\nPrompt: 7 tokens" in got.output, got.output
    assert text != _mlx_lm_text(mlx_lm_model)  # the option changed what mlx-lm generates, and ours with it


def test_a_draft_model_leaves_greedy_output_unchanged_and_says_what_it_proposed():
    plain = jobs.smoke_test.run(model=MODEL, prompt=PROMPT, max_tokens=24)
    draft = jobs.smoke_test.run(model=MODEL, prompt=PROMPT, max_tokens=24, draft_model=MODEL,
                                generation=GenOptions(num_draft_tokens=3))
    assert draft.generation.tokens == plain.generation.tokens
    assert plain.generation.draft_tokens is None and 0 < draft.generation.draft_tokens <= 24
    assert f"({draft.generation.draft_tokens} accepted from the draft model)" in draft.generation.stats_line()


def test_steering_governs_the_tokens_with_a_draft_model(tmp_path):
    """The draft model (here the same weights, loaded apart) is never steered: greedy steered output with it is the
    steered output without it, and differs from the unsteered one."""
    from mlx_fun.model.io import read_config

    layers = read_config(MODEL)["num_hidden_layers"]
    report = tmp_path / "domain.json"
    report.write_text(json.dumps({"domain_experts": {str(i): [0, 1, 2, 3] for i in range(layers)}}))
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, steering=SteerOptions(domain_map=report, domain_mode="boost"))
    steered = jobs.steer.run(**kw, compare=True)
    drafted = jobs.steer.run(**kw, draft_model=MODEL)
    assert drafted.generation.tokens == steered.generation.tokens != steered.baseline.tokens
    assert drafted.generation.draft_tokens is not None


@pytest.mark.parametrize("kw, needle", [
    (dict(kv_bits=4, max_kv_size=64), "kv_bits= and max_kv_size= do not go together"),
    (dict(max_kv_size=64, draft_model=MODEL), "max_kv_size= does not work with draft_model="),
    (dict(kv_bits=7), "kv_bits= must be one of 2, 3, 4, 5, 6, 8"),
    (dict(kv_group_size=0), "kv_group_size= must be one of 32, 64, 128"),
    (dict(quantized_kv_start=-1), "quantized_kv_start= must be a whole number >= 0"),
    (dict(num_draft_tokens=0, draft_model=MODEL), "num_draft_tokens= must be a whole number >= 1"),
    (dict(max_kv_size=True), "max_kv_size= must be a whole number >= 1"),
])
def test_bad_options_are_one_line_before_loading(kw, needle):
    kw = dict(kw)
    draft = kw.pop("draft_model", None)
    with pytest.raises(UserError, match=needle):
        jobs.smoke_test.run(model=MODEL, generation=GenOptions(**kw), draft_model=draft)


def test_cli_refusals(tmp_path, make_model):
    expect_error(run("smoke-test", "--model", MODEL, "--kv-bits", 4, "--max-kv-size", 8), "--kv-bits and --max-kv-size")
    (tmp_path / "domain.json").write_text("{}")  # a map that exists (a missing one is refused before the options)
    expect_error(run("steer", "--model", MODEL, "--prompt", "x", "--domain-map", tmp_path / "domain.json",
                     "--domain-mode", "boost", "--draft-model", MODEL, "--max-kv-size", 8),
                 "--max-kv-size does not work with --draft-model")
    expect_error(run("smoke-test", "--model", MODEL, "--draft-model", tmp_path / "missing"), "--draft-model",
                 "missing")
    other = make_model("qwen3_moe")  # the tests' own tokenizer: another vocabulary than the bundled model's
    expect_error(run("smoke-test", "--model", MODEL, "--draft-model", other, "--max-tokens", 4),
                 f"--draft-model {other} has a vocabulary of", "speculative decoding needs the same tokenizer")
    bad = run("smoke-test", "--model", MODEL, "--kv-bits", 7)
    assert bad.exit_code == 2 and "'7' is not one of" in bad.output


def test_a_backend_without_quantized_kv_attention_is_one_line(monkeypatch):
    """MLX 0.32.4's CUDA backend has no quantized matmul for mlx-lm's quantized KV attention (measured on an H100:
    docs/benchmarks/kv.md); --kv-bits there used to die mid-generation with an internal error. The check runs
    mlx-lm's own function on the layouts seen to fail; here it is made to fail as CUDA's does."""
    import mlx_lm.models.base as base

    def refuse(*_a, **_k):
        raise RuntimeError('[quantized_matmul] No implementation for problem shape: 1x9x64x4, transpose: true, '
                           'activation: float32, bits: 4, group size: 64, mode: "affine".')

    monkeypatch.setattr(base, "quantized_scaled_dot_product_attention", refuse)
    expect_error(run("smoke-test", "--model", MODEL, "--kv-bits", 4),
                 "--kv-bits 4 cannot run on this backend", "No implementation for problem shape", "drop --kv-bits")
    assert run("smoke-test", "--model", MODEL, "--max-tokens", 4).exit_code == 0  # without it: fine
