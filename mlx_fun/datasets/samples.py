"""Calibration datasets → lists of token ids, and padded batches of them.

``--dataset`` is either a JSONL file or a directory.

**JSONL file** (any path that is not a directory is read as JSONL; blank lines are skipped). The format is
detected per line, so one file may mix them. When a line has the keys of several formats, the first one in
this list wins:

1. ``{"messages": [{"role": "user", "content": "..."}, ...]}`` — a chat, tokenized with the tokenizer's chat
   template (``tokenizer.apply_chat_template(messages, tokenize=True)``, no generation prompt). Every message
   needs a string ``role`` and a string ``content`` (``content`` may be null/absent in a message that has
   ``tool_calls``).
2. ``{"prompt": "...", "completion": "..."}`` — tokenized as the single text ``prompt + completion`` (the two
   strings are joined as they are; put any separating space or newline in the data itself).
3. ``{"content": "..."}`` — plain text under ``text_key`` (``--text-key``, default ``content``), tokenized
   with ``tokenizer.encode(text)``.

Plain texts are encoded with the tokenizer's own special tokens (a BOS for tokenizers that use one), once: a
text that already starts with the BOS token string is encoded without adding another. Chat templates already
write their special tokens, so they are never added twice either.

A line that is not valid JSON, not a JSON object, or that has none of these keys (or a value of the wrong
type) is a ``UserError`` naming the file and the 1-based line number.

**Directory**: every file below it (recursively, in sorted path order; hidden directories such as ``.git``
are skipped) whose suffix is in ``extensions`` (case-insensitive, default ``.sol`` and ``.txt``) is one
plain-text sample, read as UTF-8.

**Bytes**: JSONL lines and directory files follow one rule: they must be UTF-8 (a leading byte-order mark is
dropped), and a text file must hold no NUL bytes (a binary file); anything else is a ``UserError`` naming the
file (and line). Datasets are read in bounded pieces: one JSONL line, or one file of a directory, may be at most
``MAX_SAMPLE_BYTES`` (16 MiB); a longer one is a ``UserError``. The dataset and every file read from a directory
must be regular files (or links to them): a FIFO, a device such as ``/dev/zero`` or a socket is refused before
anything is read from it.

Samples that tokenize to no tokens are skipped; a dataset left with none is a ``UserError``. ``max_samples``
keeps a random subset (``random.Random(seed)``) in the dataset's order; ``max_tokens`` truncates every sample.
Nothing here touches the network.
"""

from __future__ import annotations

import os
import random
import stat
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..core import json_input
from ..errors import UserError, param
from ..core.json_input import json_type_name
from ..core.paths import mode_kind

DEFAULT_EXTENSIONS: tuple[str, ...] = (".sol", ".txt")
DEFAULT_TEXT_KEY = "content"
#: the most bytes one sample may take: one JSONL line, or one file of a dataset directory
MAX_SAMPLE_BYTES = 16 << 20

__all__ = [
    "DEFAULT_EXTENSIONS",
    "DEFAULT_TEXT_KEY",
    "MAX_SAMPLE_BYTES",
    "Sample",
    "count_tokens",
    "iter_batches",
    "json_type_name",
    "json_whole",
    "load_dataset",
    "load_samples",
    "pad_id",
]


@dataclass(frozen=True)
class Sample:
    """One tokenized sample and where it came from (``file:line`` for JSONL, the file path for directories)."""

    tokens: list[int]
    source: str


@dataclass(frozen=True)
class _Item:
    """A parsed, validated, not yet tokenized sample."""

    source: str
    kind: str  # "messages" | "text" | "file"
    payload: Any  # list of messages | str | Path
    where: str  # prefix for error messages, e.g. "data.jsonl line 7"


# ----------------------------------------------------------------------------------------------------------
# public API


def pad_id(tokenizer: Any) -> int:
    """The id batches are padded with: the tokenizer's pad token, else 0 (padding is never scored or counted)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return pad if pad is not None else 0


def load_samples(
    path: str | os.PathLike,
    tokenizer: Any,
    *,
    max_samples: int | None = None,
    max_tokens: int | None = 2048,
    text_key: str = DEFAULT_TEXT_KEY,
    seed: int | None = None,
    extensions: Sequence[str] | str = DEFAULT_EXTENSIONS,
    generation_prompt: bool = False,
) -> list[list[int]]:
    """Token ids of every sample of the dataset at ``path`` (see the module docstring for the formats).

    ``max_samples``: when the dataset has more non-empty samples, a random subset of that size chosen with
    ``random.Random(seed)`` (``seed=None``: a different subset each run), kept in the dataset's order. Every
    JSONL line is parsed and validated, so a malformed line is always reported, but only the chosen lines
    (files, for a directory) are tokenized (read): keeping 128 samples of a 100k-line file is fast. Errors
    that only tokenization can find (a chat template rejecting a conversation) are therefore reported for
    the chosen lines only.

    ``max_tokens``: every sample is truncated to at most this many tokens (``None``: no truncation).
    ``text_key``: the JSON key of plain-text lines. ``extensions``: the file suffixes read from a directory.
    ``generation_prompt``: a chat whose last message is the user's is tokenized with the template's generation
    prompt (the assistant header the model answers after), as a prompt is served — what routing scans read.
    """
    samples = load_dataset(
        path,
        tokenizer,
        max_samples=max_samples,
        max_tokens=max_tokens,
        text_key=text_key,
        seed=seed,
        extensions=extensions,
        generation_prompt=generation_prompt,
    )
    return [s.tokens for s in samples]


def load_dataset(
    path: str | os.PathLike,
    tokenizer: Any,
    *,
    max_samples: int | None = None,
    max_tokens: int | None = 2048,
    text_key: str = DEFAULT_TEXT_KEY,
    seed: int | None = None,
    extensions: Sequence[str] | str = DEFAULT_EXTENSIONS,
    generation_prompt: bool = False,
) -> list[Sample]:
    """Like :func:`load_samples`, but each sample also carries its source (``file:line`` or file path)."""
    if max_samples is not None and max_samples < 1:
        raise UserError(f"max samples must be at least 1, got {max_samples}; pass {param('max_samples')} 1 or more")
    if max_tokens is not None and max_tokens < 1:
        raise UserError(f"max tokens must be at least 1, got {max_tokens}; pass {param('max_tokens')} 1 or more")
    p = Path(path)
    if not p.exists():
        raise UserError(
            f"dataset {p} does not exist; pass {param('dataset')} a JSONL file or a directory of text files"
        )
    if p.is_dir():
        exts = _normalize_extensions(extensions)
        items = _directory_items(p, exts)
    else:
        items = _jsonl_items(p, text_key)
        if not items:
            raise UserError(
                f"dataset {p} is empty (no non-blank lines); write one JSON object per line, "
                f'e.g. {{"{text_key}": "..."}}'
            )

    order = list(range(len(items)))
    limit = len(items) if max_samples is None else max_samples
    if limit < len(items):
        random.Random(seed).shuffle(order)

    chosen: list[tuple[int, list[int]]] = []
    for index in order:
        if len(chosen) >= limit:
            break
        tokens = _tokenize(items[index], tokenizer, generation_prompt)
        if not tokens:
            continue  # nothing to route
        if max_tokens is not None:
            tokens = tokens[:max_tokens]
        chosen.append((index, tokens))

    if not chosen:
        raise UserError(
            f"no tokens in the dataset {p}: all {len(items)} of its samples are empty or blank (whitespace only); "
            f"add text to it"
        )
    chosen.sort(key=lambda pair: pair[0])  # the dataset's order
    return [Sample(tokens=tokens, source=items[i].source) for i, tokens in chosen]


def iter_batches(
    samples: Sequence[Sequence[int]], batch_size: int, pad_id: int = 0
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield ``(tokens, lengths)``: ``tokens`` int32 of shape ``(B, Lmax)`` right-padded with ``pad_id``,
    ``lengths`` int32 of shape ``(B,)``.

    Samples are sorted by length, longest first (ties keep their order), so each batch holds samples of
    similar length and padding is minimal. Every sample with at least one token appears in exactly one
    batch; the last batch may be smaller. Samples with no tokens are skipped (they have nothing to route).
    """
    for tokens, lengths, _rows in iter_batch_rows(samples, batch_size, pad_id):
        yield tokens, lengths


def iter_batch_rows(
    samples: Sequence[Sequence[int]], batch_size: int, pad_id: int = 0
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """:func:`iter_batches` plus ``rows`` (B,) int64: the index in ``samples`` of each row."""
    if batch_size < 1:
        raise UserError(f"batch size must be at least 1, got {batch_size}; pass {param('batch_size')} 1 or more")
    arrays = [np.asarray(s, dtype=np.int64).reshape(-1) for s in samples]
    order = sorted((i for i, a in enumerate(arrays) if a.size), key=lambda i: -arrays[i].size)
    for start in range(0, len(order), batch_size):
        rows = np.array(order[start : start + batch_size], dtype=np.int64)
        batch = [arrays[i] for i in rows]
        lengths = np.array([a.size for a in batch], dtype=np.int32)
        tokens = np.full((len(batch), int(lengths.max())), pad_id, dtype=np.int32)
        for row, a in enumerate(batch):
            tokens[row, : a.size] = a
        yield tokens, lengths, rows


def count_tokens(samples: Sequence[Sequence[int]]) -> int:
    """Total number of tokens of ``samples``."""
    return int(sum(len(s) for s in samples))


# ----------------------------------------------------------------------------------------------------------
# directories


def _normalize_extensions(extensions: Sequence[str] | str) -> tuple[str, ...]:
    if isinstance(extensions, str):
        extensions = (extensions,)
    exts = tuple(sorted({("." + e.lstrip(".")).lower() for e in extensions if e.strip(".")}))
    if not exts:
        raise UserError("no file extensions given for a dataset directory; pass e.g. extensions=('.txt',)")
    return exts


def _directory_items(root: Path, exts: tuple[str, ...]) -> list[_Item]:
    files: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            file = Path(dirpath) / name
            if file.suffix.lower() in exts:
                _check_sample_file(file)
                files.append((file.relative_to(root).as_posix(), file))
    if not files:
        raise UserError(
            f"dataset directory {root} has no files ending in {', '.join(exts)} (searched recursively); "
            f"add such files or pass {param('dataset')} a JSONL file"
        )
    files.sort(key=lambda pair: pair[0])
    return [_Item(source=str(f), kind="file", payload=f, where=str(f)) for _, f in files]


# ----------------------------------------------------------------------------------------------------------
# reading: regular files only, in bounded pieces, UTF-8


def _limit() -> str:
    return f"{MAX_SAMPLE_BYTES >> 20} MiB"


def _open_regular(path: Path, what: str, fix: str):
    """``path`` opened for binary reading, or a ``UserError`` when it is no regular file. Opened without blocking
    (opening a FIFO waits for a writer) and checked on the open descriptor, so nothing is read from a device."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UserError(f"{what} is {mode_kind(mode)}, not a regular file; {fix}")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _check_sample_file(file: Path) -> None:
    """A file of a dataset directory: a regular file (or a link to one) of at most ``MAX_SAMPLE_BYTES``."""
    fix = "remove it from the dataset directory"
    try:
        st = file.stat()
    except OSError as e:  # a dangling link, no permission to the target, ...
        raise UserError(f"cannot read {file} ({e.strerror or e}); fix it or {fix}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"dataset file {file} is {mode_kind(st.st_mode)}, not a regular file; {fix}")
    if st.st_size > MAX_SAMPLE_BYTES:
        raise UserError(f"dataset file {file} is {st.st_size / (1 << 20):,.1f} MiB, over the {_limit()} one sample "
                        f"may take; split it into smaller files")


def _read_text_file(file: Path) -> str:
    """The text of one file of a dataset directory, under the same rule as a JSONL line (UTF-8, bounded), and
    with no NUL bytes (a binary file)."""
    fix = "remove it from the dataset directory"
    try:
        with _open_regular(file, f"dataset file {file}", fix) as f:
            raw = f.read(MAX_SAMPLE_BYTES + 1)
    except OSError as e:
        raise UserError(f"cannot read {file} ({e.strerror or e}); check its permissions") from None
    if len(raw) > MAX_SAMPLE_BYTES:
        raise UserError(f"dataset file {file} is over the {_limit()} one sample may take; split it into smaller files")
    text = _decode(raw, str(file), bom=True)
    if "\0" in text:
        raise UserError(f"{file}: a NUL byte at byte {raw.index(0)}, so not a text file; {fix}")
    return text


def _decode(raw: bytes, where: str, *, bom: bool) -> str:
    """``raw`` as UTF-8 (``bom``: a leading byte-order mark dropped), or a ``UserError`` at ``where``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start}); save the file as UTF-8") from None
    return text.removeprefix("\ufeff") if bom else text


# ----------------------------------------------------------------------------------------------------------
# JSONL


def _jsonl_items(path: Path, text_key: str) -> list[_Item]:
    items: list[_Item] = []
    try:
        with _open_regular(path, f"dataset {path}", "pass a JSONL file or a directory of text files") as f:
            lineno = 0
            while raw := f.readline(MAX_SAMPLE_BYTES + 1):
                lineno += 1
                where = f"{path} line {lineno}"
                if len(raw) > MAX_SAMPLE_BYTES and not raw.endswith(b"\n"):
                    raise UserError(f"{where} is longer than {_limit()}, the most one sample may take; "
                                    f"split it, or write one JSON object per line")
                line = _decode(raw, where, bom=lineno == 1)
                if not line.strip():
                    continue
                items.append(_parse_line(line, where, f"{path}:{lineno}", text_key, path))
    except OSError as e:
        raise UserError(f"cannot read dataset {path} ({e.strerror or e}); check the path and permissions") from None
    return items


#: the largest count a config may hold (no model has more layers, experts, heads or vocabulary entries)
MAX_COUNT = 2**31 - 1


def json_whole(value: Any, minimum: int) -> bool:
    """``value`` is a JSON whole number (not a boolean) of at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _parse_line(line: str, where: str, source: str, text_key: str, path: Path) -> _Item:
    hint = "" if path.suffix.lower() in (".jsonl", ".json") else " (for plain-text files, pass a directory)"
    # NaN / Infinity pass (Python's json writes them into other fields): the text fields must be strings anyway
    obj = json_input.parse(line, where, fix=f"each line must be one JSON object such as {{\"{text_key}\": "
                                            f"\"...\"}}{hint}", expect=dict, allow_nan=True, lines=False)

    if "messages" in obj:
        return _Item(source=source, kind="messages", payload=_check_messages(obj["messages"], where), where=where)

    if "prompt" in obj and "completion" in obj:
        prompt, completion = obj["prompt"], obj["completion"]
        for key, value in (("prompt", prompt), ("completion", completion)):
            if not isinstance(value, str):
                raise UserError(f"{where}: '{key}' must be a string, got {json_type_name(value)}; fix the line")
        return _Item(source=source, kind="text", payload=prompt + completion, where=where)

    if text_key in obj:
        text = obj[text_key]
        if not isinstance(text, str):
            raise UserError(
                f"{where}: '{text_key}' must be a string, got {json_type_name(text)}; fix the line or pass "
                f"{param('text_key')} with the key that holds the text"
            )
        return _Item(source=source, kind="text", payload=text, where=where)

    keys = list(obj)
    shown = ", ".join(repr(k) for k in keys[:8]) + (", ..." if len(keys) > 8 else "")
    raise UserError(
        f"{where}: no 'messages', 'prompt'+'completion' or '{text_key}' key (found: {shown or 'none'}); "
        f"use one of these formats, or pass {param('text_key')} with the key that holds the text"
    )


def _check_messages(messages: Any, where: str) -> list[dict]:
    expected = 'a non-empty list of {"role": ..., "content": ...} objects'
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if isinstance(messages, list) else json_type_name(messages)
        raise UserError(f"{where}: 'messages' must be {expected}, got {got}; fix the line")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise UserError(
                f"{where}: 'messages'[{i}] must be an object with 'role' and 'content', "
                f"got {json_type_name(message)}; 'messages' must be {expected}"
            )
        role = message.get("role")
        if not isinstance(role, str):
            raise UserError(
                f"{where}: 'messages'[{i}] needs a string 'role', got {json_type_name(role)}; "
                f"'messages' must be {expected}"
            )
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise UserError(
                f"{where}: 'messages'[{i}] needs a string 'content', got {json_type_name(content)}; "
                f"'messages' must be {expected}"
            )
    return messages


# ----------------------------------------------------------------------------------------------------------
# tokenization


def _tokenize(item: _Item, tokenizer: Any, generation_prompt: bool = False) -> list[int]:
    if item.kind == "messages":
        prompt = generation_prompt and item.payload[-1].get("role") == "user"
        return _apply_chat_template(tokenizer, item.payload, item.where, prompt)
    if item.kind == "file":
        return _encode_text(tokenizer, _read_text_file(Path(item.payload)))
    return _encode_text(tokenizer, item.payload)


def _encode_text(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer.encode(text)`` with the tokenizer's special tokens, without doubling a BOS the text has; none
    for an empty or blank (whitespace only) text: it has nothing to route."""
    if not text.strip():
        return []
    bos = getattr(tokenizer, "bos_token", None)
    if isinstance(bos, str) and bos and text.startswith(bos):
        return _as_ids(tokenizer.encode(text, add_special_tokens=False))
    return _as_ids(tokenizer.encode(text))


def _apply_chat_template(tokenizer: Any, messages: list[dict], where: str, generation_prompt: bool = False) -> list[int]:
    if getattr(tokenizer, "has_chat_template", True) is False:
        raise UserError(
            f"{where}: 'messages' needs a chat template, but the tokenizer has none; "
            f"use prompt/completion or plain-text lines instead"
        )
    try:
        extra = {"add_generation_prompt": True} if generation_prompt else {}
        out = tokenizer.apply_chat_template(messages, tokenize=True, **extra)
    except Exception as e:  # jinja errors, "no chat template", role-order checks of templates, ...
        detail = " ".join(str(e).split())[:200]
        raise UserError(
            f"{where}: the tokenizer's chat template failed on these messages ({type(e).__name__}: {detail}); "
            f"fix the messages or use prompt/completion lines"
        ) from None
    return _as_ids(out)


def _as_ids(out: Any) -> list[int]:
    """A plain ``list[int]`` from whatever a tokenizer returned (list, dict/BatchEncoding, array, batch of 1)."""
    if isinstance(out, Mapping) or (hasattr(out, "keys") and hasattr(out, "__getitem__")):
        if "input_ids" not in out:
            raise TypeError(f"tokenizer returned a mapping without 'input_ids': {sorted(out.keys())}")
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if isinstance(out, int):
        return [out]
    out = list(out)
    if len(out) == 1 and not isinstance(out[0], (int, np.integer)) and hasattr(out[0], "__len__"):
        out = list(out[0].tolist() if hasattr(out[0], "tolist") else out[0])  # a batch of one
    return [int(t) for t in out]
