"""The tokenizer without transformers (:mod:`mlx_fun.model.fast_tokenizer`, issue 44 part 1) gives transformers'
ids, text and prompts, token for token and character for character, on every tokenizer the tests build.

mlx-lm's own ``tokenizer_utils.load`` loads each directory twice: in a fresh interpreter set up as the console entry
sets up a tokenizing command (:func:`mlx_fun.runtime.lean_imports.defer_transformers`: transformers is never
imported there), and here, with transformers. :func:`outputs` (ids with and without special tokens, decoded text,
vocabulary, special tokens, the streaming detokenizer, rendered chat prompts) must be equal. A directory the fast
path does not cover (another class, ``auto_map``, a model type transformers gives its own class) loads through
transformers there too, with the same answers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .cli_helpers import python_path

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = [ROOT / "data" / "tiny-moe", ROOT / "data" / "tiny-moe-chat"]

TEXTS = ["", "Hello world!", "  leading, trailing  ", "tabs\tand\n\nnewlines\r\n  runs     of spaces",
         "unicode: naïve café — 日本語 🤖 ﬁ Ω≈ç√", "special <|im_start|>user\nhi<|im_end|> inside <|endoftext|>",
         "<|im_end|>", "def f(x):\n    return x ** 2  # comment", "a ,b . c ! d ' e n't 's"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi <|im_end|> there"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And 日本?"}],
    [{"role": "user", "content": "Finish this"}, {"role": "assistant", "content": "Paris is  "}],
]
#: a template with what transformers' sandbox adds (tojson, namespace, loop controls, raise_exception, trimmed
#: blocks) and the variables it passes (special tokens, add_generation_prompt, enable_thinking, tools)
RICH = """{%- set ns = namespace(n=0) -%}
{% if tools %}{{ tools | tojson(indent=2) }}
{% endif %}
{% for message in messages %}
  {% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}
  {% set ns.n = ns.n + 1 %}
  {% if loop.index0 > 8 %}{% break %}{% endif %}
<|im_start|>{{ message['role'] }} {{ ns.n }}
{{ message['content'] | trim }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking %}<think>
{% endif %}{% endif %}"""
#: the directories compared whole (:func:`outputs`): one of each tokenizer the tests build
FULL: list[str] = []
TOOLS = [{"type": "function", "function": {"name": "f", "description": "é", "parameters": {"type": "object"}}}]


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _chat(tokenizer, *args, **kwargs):
    try:
        return tokenizer.apply_chat_template(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the error's type is the answer
        return f"raised {type(e).__name__}"


def outputs(tokenizer, full: bool = True) -> dict:
    """What mlx-lm and mlx-fun read from a loaded ``TokenizerWrapper``, as JSON; not ``full``: the ids of
    :data:`TEXTS` and a prompt (for the same tokenizer under another model type)."""
    if not full:
        return {"ids": [tokenizer.encode(text) for text in TEXTS],
                "prompt": tokenizer.apply_chat_template(CHATS[1], add_generation_prompt=True)}
    inner = tokenizer._tokenizer
    out = {"len": len(tokenizer), "vocab_size": tokenizer.vocab_size, "vocab": _digest(tokenizer.get_vocab()),
           "tokens": _digest(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))),
           "has_chat_template": tokenizer.has_chat_template, "has_thinking": tokenizer.has_thinking,
           "eos_token_ids": sorted(tokenizer.eos_token_ids), "all_special_ids": inner.all_special_ids,
           "special_tokens_map": inner.special_tokens_map, "detokenizer": type(tokenizer.detokenizer).__name__,
           "to_ids": tokenizer.convert_tokens_to_ids(["<|im_end|>", "no such token", "Hello"])}
    for name in ("bos", "eos", "unk", "pad"):
        out[name] = [getattr(inner, f"{name}_token"), getattr(inner, f"{name}_token_id")]
    for i, text in enumerate(TEXTS):
        ids = tokenizer.encode(text)
        plain = tokenizer.encode(text, add_special_tokens=False)
        detok = tokenizer.detokenizer
        for token in ids:
            detok.add_token(token)
        detok.finalize()
        out[f"text{i}"] = [ids, plain, tokenizer.decode(ids), tokenizer.decode(ids, skip_special_tokens=True),
                           detok.text]
    for i, chat in enumerate(CHATS):
        for template in (None, RICH):
            extra = {} if template is None else {"chat_template": template, "tools": TOOLS}
            for think in (False, True):
                out[f"chat{i}-{template is None}-{think}"] = [
                    _chat(tokenizer, chat, tokenize=False, enable_thinking=think, **extra),
                    _chat(tokenizer, chat, tokenize=False, add_generation_prompt=True, enable_thinking=think,
                          **extra),
                    _chat(tokenizer, chat, tokenize=True, add_generation_prompt=True, **extra),
                    _chat(tokenizer, chat, tokenize=False, continue_final_message=True, **extra),
                ]
    return out


def refusals(tokenizer) -> dict:
    """What transformers refuses (the fast tokenizer hands these to it, which imports it)."""
    return {"both": _chat(tokenizer, CHATS[2], tokenize=False, continue_final_message=True,
                          add_generation_prompt=True),
            "empty": _chat(tokenizer, [], tokenize=False)}


#: run in a fresh interpreter: the console entry's set-up of a tokenizing command, then mlx-lm's own load
FRESH = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from mlx_fun.runtime import lean_imports
from mlx_fun.model import fast_tokenizer
lean_imports.block_torch()
lean_imports.defer_mlx_lm()
assert lean_imports.defer_transformers(fast=fast_tokenizer.load,
                                       renderer=fast_tokenizer.FastTokenizer.apply_chat_template)
from mlx_lm.tokenizer_utils import load
from tests.test_fast_tokenizer import outputs, refusals
fast, dirs, full = json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
result, loaded = {}, {}
for d in fast + dirs:  # the directories the fast path covers first: transformers is not imported for them
    loaded[d] = tokenizer = load(Path(d))
    result[d] = {"class": type(tokenizer._tokenizer).__name__, **outputs(tokenizer, d in full)}
    result[d]["transformers"] = "transformers" in sys.modules
for d in full:
    result[d].update(refusals(loaded[d]))
print("RESULT=" + json.dumps(result))
"""


def _one_per_class(model_types: list[str]) -> list[str]:
    """One model type of each way transformers' AutoTokenizer may pick a class for it (what its tokenizer
    mapping names, whether it overrides the config's class); every type where those names are not there."""
    try:
        from transformers.models.auto import tokenization_auto as auto

        key = lambda t: (auto.TOKENIZER_MAPPING_NAMES.get(t), t in auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS)
    except (ImportError, AttributeError):
        return model_types
    return list({key(t): t for t in reversed(model_types)}.values())[::-1]


@pytest.fixture(scope="module")
def directories(tmp_path_factory, tokenizer_dir) -> tuple[list[Path], list[Path]]:
    """(the fast path's, transformers'): the bundled models, the tests' tokenizer under the config of every
    supported model type, its vocabulary with two ids swapped (test_eval), and some it does not cover. The first
    of each kind of tokenizer is in :data:`FULL`, compared whole; the others by ids and a prompt."""
    from mlx_fun.adapters import supported_model_types
    from mlx_fun.testing.tiny import tiny_config

    root = tmp_path_factory.mktemp("tokenizers")

    def copy(name: str, config: dict, source: Path = tokenizer_dir) -> Path:
        out = root / name
        out.mkdir()
        for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copyfile(source / file, out / file)
        (out / "config.json").write_text(json.dumps(config))
        return out

    from mlx_fun.model.fast_tokenizer import OWN_CLASS_TYPES

    fast, other = list(BUNDLED), []
    for model_type in _one_per_class(["qwen3_moe"] + [t for t in supported_model_types() if t != "qwen3_moe"]):
        try:
            config = tiny_config(model_type)
        except ValueError:  # an alias: the config of the type it names, under its own name
            config = {"model_type": model_type}
        (other if model_type in OWN_CLASS_TYPES else fast).append(copy(model_type, {**config, "model_type": model_type}))
    swapped = copy("swapped", tiny_config("qwen3_moe"))
    tj = json.loads((swapped / "tokenizer.json").read_text())
    a, b = list(tj["model"]["vocab"])[100:102]
    tj["model"]["vocab"][a], tj["model"]["vocab"][b] = tj["model"]["vocab"][b], tj["model"]["vocab"][a]
    (swapped / "tokenizer.json").write_text(json.dumps(tj))
    fast.append(swapped)
    bare = copy("bare", tiny_config("qwen3_moe"))  # no chat template (test_serve_flags)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    (bare / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    fast.append(bare)
    FULL[:] = [str(d) for d in (*BUNDLED, root / "qwen3_moe", swapped, bare)]
    for name, change in (("gpt2-class", {"tokenizer_class": "GPT2TokenizerFast"}),
                         ("auto-map", {"auto_map": {"AutoTokenizer": [None, "PreTrainedTokenizerFast"]}}),
                         ("extra-key", {"legacy": False})):
        out = copy(name, tiny_config("qwen3_moe"))
        config = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
        other.append(out)
    other.append(copy("qwen2", {"model_type": "qwen2"}))  # transformers' Qwen2Tokenizer for this type
    return fast, other


@pytest.fixture(scope="module")
def fresh(directories) -> dict:
    fast, other = directories
    proc = subprocess.run([sys.executable, "-c", FRESH, str(Path(__file__).parents[1]),
                           json.dumps(list(map(str, fast))), json.dumps(list(map(str, other))), json.dumps(FULL)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": python_path()})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT=")]
    return json.loads(line[-1].split("=", 1)[1])


def test_the_fast_path_gives_transformers_ids_text_and_prompts(directories, fresh):
    from mlx_lm.tokenizer_utils import load

    fast, _ = directories
    unequal = {}
    for d in fast:
        got = fresh[str(d)]
        assert got.pop("class") == "FastTokenizer" and got.pop("transformers") is False, d
        tokenizer = load(d)
        if str(d) not in FULL:
            want = outputs(tokenizer, full=False)
        else:
            want = {**outputs(tokenizer), **refusals(tokenizer)}
            assert want["both"] == want["empty"] == "raised ValueError"
            assert want["has_chat_template"] is (d.name != "bare")  # mlx-lm sees no custom renderer
            assert want["chat0-True-False"][1] == ("raised ValueError" if d.name == "bare" else
                                                   "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                                                   "<|im_start|>assistant\n")
        if got != want:
            unequal[d.name] = [k for k in want if got.get(k) != want[k]]
    assert not unequal


def test_a_tokenizer_it_does_not_cover_loads_through_transformers(directories, fresh):
    from mlx_lm.tokenizer_utils import load

    _, other = directories
    for d in other:
        got = fresh[str(d)]
        assert got.pop("class") != "FastTokenizer" and got.pop("transformers") is True, d
        assert got == outputs(load(d), full=False), d


def test_what_the_fast_tokenizer_does_not_do_is_transformers_own(tmp_path):
    """An option it does not implement (a batch, return_dict, a message with reasoning) is handed to transformers'
    tokenizer of the same directory, loaded then."""
    from transformers import AutoTokenizer

    from mlx_fun.model import fast_tokenizer

    fast, real = fast_tokenizer.load(BUNDLED[1]), AutoTokenizer.from_pretrained(BUNDLED[1])
    chat = [{"role": "user", "content": "hi", "reasoning_content": "hmm"}]
    assert fast._real_tokenizer is None
    assert fast.apply_chat_template(chat, tokenize=False) == real.apply_chat_template(chat, tokenize=False)
    assert fast._real_tokenizer is not None
    assert fast(["a b", "c"])["input_ids"] == real(["a b", "c"])["input_ids"]
    assert dict(fast.apply_chat_template(CHATS[0])) == dict(real.apply_chat_template(CHATS[0]))
    assert fast.decode([[5, 6], [7]]) == real.decode([[5, 6], [7]])
    assert fast.decode(fast.encode("a ,b"), clean_up_tokenization_spaces=True) == real.decode(
        real.encode("a ,b"), clean_up_tokenization_spaces=True)
    assert fast.model_input_names == real.model_input_names
