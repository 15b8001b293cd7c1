"""Issue 44 part 2: mlx_lm.server's flags on `serve`. --temp / --top-p / --top-k / --min-p are the sampling of a
request that gives none (as mlx_lm.server), --chat-template-args reach every request's template (a request's
chat_template_kwargs add to them), --adapter-path serves (and counts) the fine-tune, fused as smoke-test fuses it,
and a default chat template the tokenizer lacks is one line. One module-scoped server."""

from __future__ import annotations

import json
import shutil

import pytest

from mlx_fun import jobs
from mlx_fun.errors import UserError
from mlx_fun.serve.options import ServerOptions
from mlx_fun.testing.tiny import make_tiny_adapter

from .cli_helpers import expect_error, run
from .test_serve import call

PROMPT = "The quick brown fox"
#: a template that renders a keyword argument, so the arguments a request's template got can be counted
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{{ suffix }}<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def tuned(make_model, tmp_path_factory):
    model = make_model("qwen3_moe")
    return model, make_tiny_adapter(model, tmp_path_factory.mktemp("adapter") / "adapters", seed=2)


@pytest.fixture(scope="module")
def server(tuned):
    model, adapter = tuned
    options = ServerOptions(port=0, temp=0.9, top_k=5, chat_template=TEMPLATE,
                            chat_template_args={"suffix": "and these words too "})
    served = jobs.serve.start(model=model, adapter_path=adapter, server=options)
    yield served
    served.stop()


def _complete(server, **body) -> dict:
    status, out = call(server, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, **body})
    assert status == 200, out
    return out


def test_sampling_flags_are_the_default_of_a_request_that_gives_none(server):
    text = lambda out: out["choices"][0]["text"]  # noqa: E731
    defaulted = text(_complete(server, seed=3))
    assert defaulted == text(_complete(server, seed=3, temperature=0.9, top_k=5))
    assert defaulted != text(_complete(server, seed=3, temperature=0.0))
    status, info = call(server, "GET", "/v1/reap/info")
    assert status == 200 and info["generation"]["temp"] == 0.9 and info["generation"]["top_k"] == 5


def test_chat_template_args_reach_every_request_and_a_request_adds_to_them(server):
    def prompt_tokens(**extra) -> int:
        status, out = call(server, "POST", "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra})
        assert status == 200, out
        return out["usage"]["prompt_tokens"]

    assert prompt_tokens() > prompt_tokens(chat_template_kwargs={"suffix": ""})


def test_the_adapter_is_served_fused_as_smoke_test_fuses_it(server, tuned):
    """The same greedy tokens as smoke-test with the adapter, other ones without it. Token ids, not text: how a
    trailing incomplete UTF-8 character is flushed differs between mlx-lm's server paths (a CI run once served
    the same tokens without the final U+FFFD that smoke-test's text ends in)."""
    model, adapter = tuned
    out = _complete(server, temperature=0.0, logprobs=True)["choices"][0]
    served = [t["id"] for t in out["logprobs"]["content"]]
    local = jobs.smoke_test.run(model=model, adapter_path=adapter, prompt=PROMPT, ignore_chat_template=True,
                                max_tokens=12).generation
    plain = jobs.smoke_test.run(model=model, prompt=PROMPT, ignore_chat_template=True, max_tokens=12).generation
    assert len(served) == 12 and served == list(local.tokens) != list(plain.tokens)
    assert local.text.startswith(out["text"].rstrip("\ufffd"))
    status, info = call(server, "GET", "/v1/reap/info")
    assert info["adapter"]["path"] == str(adapter) and info["adapter"]["fused"] is True


def test_a_default_chat_template_the_tokenizer_lacks_is_one_line(make_model, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(make_model("qwen3_moe"), bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="^use_default_chat_template=: the tokenizer has no chat template"):
        jobs.serve.start(model=bare, server=ServerOptions(port=0, use_default_chat_template=True))
    expect_error(run("smoke-test", "--model", bare, "--use-default-chat-template"), "--use-default-chat-template")
    expect_error(run("smoke-test", "--model", bare, "--system-prompt", "Be brief."), "--system-prompt",
                 "the tokenizer has none")
    expect_error(run("serve", "--model", bare, "--chat-template-args", "[1]"), "--chat-template-args",
                 "not a JSON object")
