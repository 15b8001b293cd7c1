"""A tokenizer without transformers for the models whose tokenizer needs nothing of it: the ``tokenizers``
library's ``tokenizer.json`` and the chat template rendered as transformers renders it (0.1 s to import against
2.4-3 s for transformers on a host with PyTorch, :mod:`mlx_fun.runtime.lean_imports`).

:func:`load` answers a :class:`FastTokenizer` only for a directory whose tokenizer transformers would load
unchanged: a ``tokenizer.json`` with no truncation or padding, a ``tokenizer_config.json`` naming a class of
:data:`CLASSES` (no ``auto_map``, no remote code) with only the keys of :data:`CONFIG_KEYS`, every named special
token already a special token of ``tokenizer.json``, a chat template that is one string, a model type of
:data:`MODEL_TYPES` (transformers picks its class for some model types over the one the config names); anything
else is None, and the caller loads transformers' own. tests/test_fast_tokenizer.py compares ids, decoded text,
vocabularies, special tokens and rendered chat prompts with transformers' on every tokenizer the tests build.

A :class:`FastTokenizer` has the part of ``PreTrainedTokenizerFast``'s API that mlx-lm's ``TokenizerWrapper``, its
streaming detokenizers, ``stream_generate`` and mlx-fun use; for anything else (an unknown attribute, a batch, an
option such as ``return_dict=True`` or ``padding``) it loads transformers' tokenizer of the same directory and
hands the call to it, so an answer is transformers' or transformers' own.
"""

from __future__ import annotations

import functools
import json
import operator
from datetime import datetime
from pathlib import Path
from typing import Any

#: ``tokenizer_class`` values the parity test covers (transformers 5 loads them as its ``TokenizersBackend``)
CLASSES = frozenset({"PreTrainedTokenizerFast"})
#: the named special tokens, in transformers' order (``SPECIAL_TOKENS_ATTRIBUTES``)
SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: ``tokenizer_config.json`` keys whose effect this class reproduces (or that change no id nor prompt)
CONFIG_KEYS = frozenset({
    "tokenizer_class", *SPECIAL, "model_max_length", "add_bos_token", "add_eos_token", "chat_template",
    "clean_up_tokenization_spaces", "added_tokens_decoder", "padding_side", "truncation_side",
    "model_input_names", "split_special_tokens", "name_or_path",
})
#: files next to the tokenizer that transformers reads and this class does not
UNSUPPORTED_FILES = ("added_tokens.json", "chat_template.json", "additional_chat_templates", "tokenizer.model")
#: transformers prefers its own class for some model types over the one the config names (Qwen2Tokenizer for
#: ``qwen2``): a tokenizer goes to transformers unless its model type is one the parity test loads (mlx-fun's
#: supported families, filled on first use from :func:`mlx_fun.adapters.supported_model_types`) and not one of
#: :data:`OWN_CLASS_TYPES`, where that test found transformers' class to give other ids (transformers 5.24)
MODEL_TYPES: frozenset[str] = frozenset()
OWN_CLASS_TYPES = frozenset({"qwen3_5", "qwen3_5_moe"})
#: transformers patches the pre-tokenizer of large vocabularies (its Mistral regex fix): those go to it
MAX_VOCAB = 100_000
#: transformers' marker for continue_final_message
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
#: message keys rendered as given (reasoning fields are renamed by some transformers versions: those go to it)
_MESSAGE_KEYS = frozenset({"role", "content"})


def _model_types() -> frozenset[str]:
    global MODEL_TYPES
    if not MODEL_TYPES:
        from ..adapters import supported_model_types

        MODEL_TYPES = frozenset(supported_model_types()) - OWN_CLASS_TYPES
    return MODEL_TYPES


def _read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(value: Any) -> str | None:
    """A special token as the config gives it: a string, an ``AddedToken`` dict (its content) or None."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(value)


def _special_tokens(path: Path, config: dict) -> dict[str, str] | None:
    """The named special tokens, from the config and ``special_tokens_map.json`` (None where they disagree or a
    value is not a token)."""
    tokens: dict[str, str] = {}
    file = path / "special_tokens_map.json"
    extra = _read_json(file) if file.is_file() else {}
    if not isinstance(extra, dict) or set(extra) - set(SPECIAL):
        return None
    for key in SPECIAL:
        try:
            mine, theirs = _token_text(config.get(key)), _token_text(extra.get(key))
        except ValueError:
            return None
        if key in config and key in extra and mine != theirs:
            return None
        value = mine if key in config else theirs
        if value is not None:
            tokens[key] = value
    return tokens


def _chat_template(path: Path, config: dict) -> tuple[bool, str | None]:
    """(supported, template): ``chat_template.jinja`` over the config's, as transformers reads them."""
    file = path / "chat_template.jinja"
    if file.is_file():
        with open(file, encoding="utf-8") as f:
            return True, f.read()
    template = config.get("chat_template")
    return template is None or isinstance(template, str), template


def _model_type(path: Path) -> str | None:
    file = path / "config.json"
    try:
        return _read_json(file).get("model_type") if file.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None


def _eligible_config(path: Path, kwargs: dict) -> dict | None:
    """``tokenizer_config.json`` when transformers would load this directory as :class:`FastTokenizer` does."""
    if any(value not in (None, False) for value in kwargs.values()):  # trust_remote_code or options
        return None
    if not (path / "tokenizer.json").is_file() or not (path / "tokenizer_config.json").is_file():
        return None
    if any((path / name).exists() for name in UNSUPPORTED_FILES):
        return None
    config = _read_json(path / "tokenizer_config.json")
    if not isinstance(config, dict) or set(config) - CONFIG_KEYS or config.get("tokenizer_class") not in CLASSES:
        return None
    if any(config.get(key) for key in ("add_bos_token", "add_eos_token", "split_special_tokens")):
        return None
    if config.get("clean_up_tokenization_spaces") is not False:  # transformers' default has changed
        return None
    if _model_type(path) not in _model_types():
        return None
    return config


def load(path: str | Path, kwargs: dict | None = None) -> FastTokenizer | None:
    """The tokenizer of ``path`` without transformers, or None where transformers must load it (see the module
    docstring). ``kwargs``: what the caller would pass to ``AutoTokenizer.from_pretrained``."""
    path = Path(path)
    kwargs = dict(kwargs or {})
    try:
        config = _eligible_config(path, kwargs)
        if config is None:
            return None
        special = _special_tokens(path, config)
        supported, template = _chat_template(path, config)
        if special is None or not supported:
            return None
        return FastTokenizer._build(path, config, special, template, kwargs)
    except (OSError, ValueError, TypeError, KeyError):
        return None


class FastTokenizer:
    """``PreTrainedTokenizerFast`` of a directory :func:`load` accepts, on the ``tokenizers`` library alone."""

    is_fast = True

    @classmethod
    def _build(cls, path: Path, config: dict, special: dict[str, str], template: str | None,
               kwargs: dict) -> FastTokenizer | None:
        from tokenizers import Tokenizer, processors

        raw = _read_json(path / "tokenizer.json")
        if raw.get("truncation") is not None or raw.get("padding") is not None:
            return None
        added = {token["content"]: token for token in raw.get("added_tokens", [])}
        if any(not added.get(token, {}).get("special") for token in special.values()):
            return None  # transformers would add it
        for index, token in (config.get("added_tokens_decoder") or {}).items():
            mine = added.get(_token_text(token))
            if mine is None or mine["id"] != int(index):
                return None
        backend = Tokenizer.from_file(str(path / "tokenizer.json"))
        if backend.get_vocab_size(with_added_tokens=True) > MAX_VOCAB:
            return None
        if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
            # transformers' update_post_processor, with neither token added
            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1",
                                                                   special_tokens=[])
        self = cls.__new__(cls)
        self._backend, self._special, self._kwargs = backend, special, kwargs
        self._real_tokenizer = None
        self.name_or_path = str(path)
        self.chat_template = template
        self.clean_up_tokenization_spaces = False
        self.model_max_length = config.get("model_max_length")
        self.init_kwargs = {**config, "name_or_path": str(path)}
        return self

    # what transformers does that this class does not: its own tokenizer of the directory, loaded on first use
    def _real(self):
        if self._real_tokenizer is None:
            from transformers import AutoTokenizer

            self._real_tokenizer = AutoTokenizer.from_pretrained(self.name_or_path, **self._kwargs)
            self._real_tokenizer.chat_template = self.chat_template
        return self._real_tokenizer

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_backend", "_special", "_kwargs", "_real_tokenizer"):
            raise AttributeError(name)
        if name.endswith("_token") and name in SPECIAL:
            return self._special.get(name)
        if name.endswith("_token_id") and name[:-3] in SPECIAL:
            token = self._special.get(name[:-3])
            return None if token is None else self.convert_tokens_to_ids(token)
        return getattr(self._real(), name)

    def __call__(self, *args, **kwargs):
        return self._real()(*args, **kwargs)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"FastTokenizer(name_or_path={self.name_or_path!r}, vocab_size={len(self)})"

    @property
    def backend_tokenizer(self):
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {key: self._special[key] for key in SPECIAL if key in self._special}

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys(self.special_tokens_map.values()))

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            index = self._backend.token_to_id(tokens)
            return self.unk_token_id if index is None else index
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def encode(self, text, text_pair=None, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if not isinstance(text, str) or text_pair is not None or any(v not in (None, False) for v in kwargs.values()):
            return self._real().encode(text, text_pair=text_pair, add_special_tokens=add_special_tokens, **kwargs)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None,
               **kwargs) -> str:
        ids = token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids
        try:
            ids = [operator.index(ids)] if not isinstance(ids, (list, tuple)) else [operator.index(i) for i in ids]
        except TypeError:  # a batch, or not ids
            ids = None
        if ids is None or clean_up_tokenization_spaces or kwargs:
            return self._real().decode(token_ids, skip_special_tokens=skip_special_tokens,
                                       clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation, tools=None, documents=None, chat_template=None,
                            add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                            tokenize: bool = True, return_dict: bool = True, **kwargs):
        """transformers' ``apply_chat_template`` (``render_jinja_template``) for one conversation of role /
        content messages, rendered to text or ids (``return_dict=False``); anything else is transformers'."""
        template = self.chat_template if chat_template is None else chat_template
        if template is None:  # transformers' error, without importing it
            raise ValueError(NO_TEMPLATE)
        def transformers_own():
            return self._real().apply_chat_template(
                conversation, tools=tools, documents=documents, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                tokenize=tokenize, return_dict=return_dict, **kwargs)

        options = {key: value for key, value in kwargs.items() if key in _TRANSFORMERS_OPTIONS}
        if (not _plain_chat(conversation) or not _plain(tools) or not _plain(documents) or not _plain(kwargs)
                or continue_final_message not in (False, True) or (tokenize and return_dict)
                or not isinstance(template, str) or any(value not in (None, False) for value in options.values())
                or (continue_final_message and add_generation_prompt)):
            return transformers_own()
        variables = {key: value for key, value in kwargs.items() if key not in _TRANSFORMERS_OPTIONS}
        text = render(template, [dict(m) for m in conversation], tools=tools, documents=documents,
                      add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                      **{**self.special_tokens_map, **variables})
        if text is None:  # transformers' error of continue_final_message (add_generation_prompt is False here)
            return transformers_own()
        return self.encode(text, add_special_tokens=False) if tokenize else text


NO_TEMPLATE = ("Cannot use chat template functions because tokenizer.chat_template is not set and no template "
               "argument was passed! For information about writing templates and setting the "
               "tokenizer.chat_template attribute, please see the documentation at "
               "https://huggingface.co/docs/transformers/main/en/chat_templating")
#: apply_chat_template's own options (not template variables): any other value than the default is transformers'
_TRANSFORMERS_OPTIONS = frozenset({"sanitize_control_tokens", "padding", "truncation", "max_length",
                                   "return_tensors", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def _plain(value: Any) -> bool:
    """JSON data of exact types (what transformers' ``_plain_template_data`` leaves as it is)."""
    if value is None or type(value) in (str, int, float, bool):
        return True
    if type(value) is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    if type(value) is list:
        return all(_plain(v) for v in value)
    return False


def _plain_chat(conversation: Any) -> bool:
    return (type(conversation) is list and len(conversation) > 0
            and all(type(m) is dict and set(m) <= _MESSAGE_KEYS and type(m.get("role")) is str
                    and type(m.get("content")) is str for m in conversation))


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    """transformers' ``_compile_jinja_template``: a sandbox with its filters, globals and extensions."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class AssistantTracker(Extension):  # parses {% generation %}; renders its body as it is
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _generation_support(self, context, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute.")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[AssistantTracker, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env.from_string(template)


def render(template: str, messages: list[dict], *, tools=None, documents=None, add_generation_prompt: bool = False,
           continue_final_message: bool = False, **variables) -> str | None:
    """One conversation rendered as transformers' ``render_jinja_template`` renders it; None where transformers
    refuses ``continue_final_message`` (its error is then transformers' own)."""
    compiled = _compile(template)
    if continue_final_message:
        final = messages[-1]["content"]
        if "content" not in template:
            return None
        messages[-1] = {**messages[-1], "content": final + _CONTINUE_TAG}
    text = compiled.render(messages=messages, tools=tools, documents=documents,
                           add_generation_prompt=add_generation_prompt, **variables)
    if not continue_final_message:
        return text
    if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
        return None
    at = text.rindex(_CONTINUE_TAG.strip())
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


__all__ = ["CLASSES", "FastTokenizer", "load", "render"]
