"""mlx_fun.datasets.samples: JSONL formats, directories, subsets, truncation, error messages and padded batches."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from mlx_fun.datasets.samples import count_tokens, iter_batches, load_dataset, load_samples
from mlx_fun.errors import UserError

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
]


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(Path(tokenizer_dir))


def write_jsonl(path: Path, rows) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def enc(tok, text: str) -> list[int]:
    return list(tok.encode(text))


# --------------------------------------------------------------------------------------------- formats


def test_messages_equal_chat_template(tmp_path, tok):
    f = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    [sample] = load_samples(f, tok)
    expected = tok.apply_chat_template(CHAT, tokenize=True)
    assert sample == list(expected)
    assert all(type(t) is int for t in sample)
    # the template really was applied: its special tokens are there
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert sample[0] == im_start and sample.count(im_start) == 3


def test_prompt_completion_is_one_text(tmp_path, tok):
    f = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Hello world! ", "completion": "The quick brown fox."}])
    assert load_samples(f, tok) == [enc(tok, "Hello world! The quick brown fox.")]


def test_text_default_and_custom_key(tmp_path, tok):
    f = write_jsonl(tmp_path / "t.jsonl", [{"content": "The lazy dog."}, {"content": "Paris is nice."}])
    assert load_samples(f, tok) == [enc(tok, "The lazy dog."), enc(tok, "Paris is nice.")]

    g = write_jsonl(tmp_path / "t2.jsonl", [{"text": "Hello world!", "content": "ignored"}])
    assert load_samples(g, tok, text_key="text") == [enc(tok, "Hello world!")]
    # with the default key the same line reads "content"
    assert load_samples(g, tok) == [enc(tok, "ignored")]


def test_mixed_formats_blank_lines_and_sources(tmp_path, tok):
    rows = [
        {"content": "first text"},
        "",
        {"messages": CHAT[1:]},
        "   ",
        {"prompt": "Q: ", "completion": "A."},
    ]
    f = write_jsonl(tmp_path / "mixed.jsonl", rows)
    samples = load_dataset(f, tok)
    assert [s.tokens for s in samples] == [
        enc(tok, "first text"),
        list(tok.apply_chat_template(CHAT[1:], tokenize=True)),
        enc(tok, "Q: A."),
    ]
    assert [s.source for s in samples] == [f"{f}:1", f"{f}:3", f"{f}:5"]


def test_priority_messages_over_prompt_over_text(tmp_path, tok):
    rows = [
        {"messages": CHAT, "prompt": "p", "completion": "c", "content": "plain"},
        {"prompt": "p ", "completion": "c", "content": "plain"},
    ]
    f = write_jsonl(tmp_path / "prio.jsonl", rows)
    assert load_samples(f, tok) == [list(tok.apply_chat_template(CHAT, tokenize=True)), enc(tok, "p c")]


def test_only_prompt_falls_back_to_text_key(tmp_path, tok):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "lonely", "content": "text wins"}])
    assert load_samples(f, tok) == [enc(tok, "text wins")]


def test_bos_not_doubled(tmp_path):
    calls = []

    class Fake:
        bos_token = "<s>"
        has_chat_template = True

        def encode(self, text, add_special_tokens=True):
            calls.append(add_special_tokens)
            return ([1] if add_special_tokens else []) + [ord(c) for c in text.removeprefix("<s>")]

    f = write_jsonl(tmp_path / "bos.jsonl", [{"content": "ab"}, {"content": "<s>ab"}])
    assert load_samples(f, Fake()) == [[1, 97, 98], [97, 98]]
    assert calls == [True, False]


def test_batch_encoding_results_become_int_lists(tmp_path):
    class DictTok:
        has_chat_template = True

        def apply_chat_template(self, messages, tokenize=True):
            return {"input_ids": np.array([[5, 6, 7]], dtype=np.int64)}

        def encode(self, text):
            return np.array([9, 8], dtype=np.int32)

    f = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}, {"content": "x"}])
    out = load_samples(f, DictTok())
    assert out == [[5, 6, 7], [9, 8]]
    assert all(type(t) is int for s in out for t in s)


def test_zero_token_samples_skipped(tmp_path, tok):
    rows = [{"content": ""}, {"content": "hello"}, {"prompt": "", "completion": ""}]
    f = write_jsonl(tmp_path / "z.jsonl", rows)
    assert load_dataset(f, tok)[0].source == f"{f}:2"
    assert load_samples(f, tok) == [enc(tok, "hello")]


def test_all_empty_is_error(tmp_path, tok):
    f = write_jsonl(tmp_path / "allempty.jsonl", [{"content": ""}, {"content": ""}])
    with pytest.raises(UserError, match=r"^no tokens in the dataset .*allempty\.jsonl: all 2 of its samples are "
                                        r"empty or blank"):
        load_samples(f, tok)


def test_only_blank_texts_are_no_tokens(tmp_path, tok):
    """Issue 41 row 12: blank `content` values (and whitespace-only .txt files) tokenized to their whitespace,
    and collect wrote a 2-token saliency file. Blank text routes nothing: skipped, and a dataset of only such
    samples is refused in one line."""
    f = write_jsonl(tmp_path / "blank.jsonl", [{"content": "   "}, {"content": "\n"}, {"content": "\t \n"}])
    with pytest.raises(UserError, match=r"^no tokens in the dataset .*blank\.jsonl: all 3 of its samples"):
        load_samples(f, tok)
    d = tmp_path / "texts"
    d.mkdir()
    (d / "a.txt").write_text("")
    (d / "b.txt").write_text("  \n\n ")
    with pytest.raises(UserError, match=r"^no tokens in the dataset .*texts: all 2 of its samples"):
        load_samples(d, tok)
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"content": " "}, {"content": "real text"}])
    assert len(load_samples(mixed, tok)) == 1


def test_collect_refuses_a_dataset_of_blank_texts(tmp_path):
    from .cli_helpers import expect_error, run

    f = write_jsonl(tmp_path / "blank.jsonl", [{"content": "  "}, {"content": "\n"}])
    model = Path(__file__).resolve().parents[1] / "data" / "tiny-moe"
    expect_error(run("collect", "--model", model, "--dataset", f, "--output", tmp_path / "s.npz"),
                 "no tokens in the dataset", "empty or blank")
    assert not (tmp_path / "s.npz").exists()
    g = tmp_path / "blank.jsonl"
    g.write_text("\n  \n\n")
    with pytest.raises(UserError, match=r"blank\.jsonl is empty"):
        load_samples(g, tok)


# --------------------------------------------------------------------------------------------- directories


def test_directory_extensions_and_recursion(tmp_path, tok):
    d = tmp_path / "corpus"
    (d / "sub" / "deeper").mkdir(parents=True)
    (d / ".git").mkdir()
    (d / "b.txt").write_text("bravo text")
    (d / "a.sol").write_text("contract A {}")
    (d / "sub" / "c.TXT").write_text("charlie upper")
    (d / "sub" / "deeper" / "d.sol").write_text("contract D {}")
    (d / "sub" / "skip.py").write_text("print('no')")
    (d / "notes.md").write_text("# no")
    (d / ".git" / "hidden.txt").write_text("hidden")
    (d / "empty.txt").write_text("")

    samples = load_dataset(d, tok)
    # sorted by relative path; empty file skipped; .py/.md and hidden dirs ignored
    assert [Path(s.source).relative_to(d).as_posix() for s in samples] == [
        "a.sol",
        "b.txt",
        "sub/c.TXT",
        "sub/deeper/d.sol",
    ]
    assert [s.tokens for s in samples] == [
        enc(tok, "contract A {}"),
        enc(tok, "bravo text"),
        enc(tok, "charlie upper"),
        enc(tok, "contract D {}"),
    ]
    # configurable extensions, with or without the dot, any case
    assert load_samples(d, tok, extensions=("PY", ".md")) == [enc(tok, "# no"), enc(tok, "print('no')")]
    assert load_samples(d, tok, extensions=".sol") == [enc(tok, "contract A {}"), enc(tok, "contract D {}")]


def test_empty_directory_error(tmp_path, tok):
    d = tmp_path / "nothing"
    d.mkdir()
    (d / "x.py").write_text("x = 1")
    with pytest.raises(UserError) as e:
        load_samples(d, tok)
    msg = str(e.value)
    assert str(d) in msg and ".sol" in msg and ".txt" in msg
    assert "\n" not in msg


def test_nonexistent_path(tmp_path, tok):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(UserError, match=r"dataset .*nope\.jsonl does not exist; .*dataset="):
        load_samples(missing, tok)


# --------------------------------------------------------------------------------------------- subsets, truncation


@pytest.fixture
def many(tmp_path):
    return write_jsonl(tmp_path / "many.jsonl", [{"content": f"sample number {i}"} for i in range(60)])


def test_max_samples_subset(many, tok):
    full = load_samples(many, tok)
    assert len(full) == 60

    a = load_samples(many, tok, max_samples=10, seed=1)
    b = load_samples(many, tok, max_samples=10, seed=1)
    c = load_samples(many, tok, max_samples=10, seed=2)
    assert len(a) == 10 and len(c) == 10
    assert a == b
    assert a != c
    # a subset of the real samples, kept in the file's order
    positions = [full.index(s) for s in a]
    assert positions == sorted(positions) and len(set(positions)) == 10

    src = [s.source for s in load_dataset(many, tok, max_samples=10, seed=1)]
    assert [int(x.rsplit(":", 1)[1]) - 1 for x in src] == positions

    # max_samples at or above the dataset size keeps everything in order
    assert load_samples(many, tok, max_samples=60, seed=3) == full
    assert load_samples(many, tok, max_samples=500) == full


def test_max_samples_only_tokenizes_chosen(many, tok):
    class Counting:
        def __init__(self, inner):
            self.inner, self.n = inner, 0

        def encode(self, text):
            self.n += 1
            return self.inner.encode(text)

    counting = Counting(tok)
    assert len(load_samples(many, counting, max_samples=5, seed=0)) == 5
    assert counting.n == 5


def test_max_samples_skips_empty_and_still_fills(tmp_path, tok):
    rows = [{"content": ""} if i % 2 else {"content": f"text {i}"} for i in range(40)]
    f = write_jsonl(tmp_path / "half.jsonl", rows)
    out = load_samples(f, tok, max_samples=15, seed=0)
    assert len(out) == 15 and all(out)


def test_malformed_line_reported_even_when_not_chosen(many, tok):
    lines = many.read_text().splitlines()
    lines.append("{broken")
    many.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=r"many\.jsonl line 61 is not valid JSON"):
        load_samples(many, tok, max_samples=1, seed=0)


def test_max_tokens_truncation(tmp_path, tok):
    text = "The quick brown fox jumps over the lazy dog. " * 20
    f = write_jsonl(tmp_path / "long.jsonl", [{"content": text}, {"content": "Hi"}])
    full = enc(tok, text)
    assert len(full) > 50
    out = load_samples(f, tok, max_tokens=50)
    assert out == [full[:50], enc(tok, "Hi")]
    assert load_samples(f, tok, max_tokens=None)[0] == full


# --------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "bad, expected",
    [
        (
            '{"content": "a" "b"}',
            r"line 3 is not valid JSON \(Expecting ',' delimiter at column 17\); each line must be one JSON object",
        ),
        ('["content", "x"]', r"line 3 holds a list, not a JSON object; each line must be one JSON object"),
        ('"just a string"', r"line 3 holds a string, not a JSON object"),
        (
            '{"body": "x", "title": "y"}',
            r"line 3: no 'messages', 'prompt'\+'completion' or 'content' key \(found: 'body', 'title'\).*text_key=",
        ),
        ('{"content": 5}', r"line 3: 'content' must be a string, got a number.*text_key="),
        ('{"messages": "hello"}', r"line 3: 'messages' must be a non-empty list .*got a string"),
        ('{"messages": []}', r"line 3: 'messages' must be a non-empty list .*got an empty list"),
        ('{"messages": ["hi"]}', r"line 3: 'messages'\[0\] must be an object with 'role' and 'content'"),
        ('{"messages": [{"role": "user"}]}', r"line 3: 'messages'\[0\] needs a string 'content', got null"),
        ('{"messages": [{"content": "x"}]}', r"line 3: 'messages'\[0\] needs a string 'role'"),
        ('{"prompt": "a", "completion": null}', r"line 3: 'completion' must be a string, got null"),
    ],
    ids=[
        "bad-json",
        "json-array",
        "json-string",
        "missing-key",
        "text-not-string",
        "messages-not-list",
        "messages-empty",
        "message-not-object",
        "message-no-content",
        "message-no-role",
        "completion-null",
    ],
)
def test_malformed_line_errors(tmp_path, tok, bad, expected):
    f = tmp_path / "data.jsonl"
    f.write_text('{"content": "ok"}\n\n' + bad + '\n{"content": "after"}\n')
    with pytest.raises(UserError) as e:
        load_samples(f, tok)
    msg = str(e.value)
    assert msg.startswith((f"{f} line 3: ", f"{f} line 3 "))
    assert "data.jsonl" in msg
    assert "\n" not in msg
    assert re.search(expected, msg), msg


def test_custom_text_key_named_in_missing_key_error(tmp_path, tok):
    f = write_jsonl(tmp_path / "k.jsonl", [{"content": "x"}])
    with pytest.raises(UserError, match=r"k\.jsonl line 1: no .* or 'body' key \(found: 'content'\)"):
        load_samples(f, tok, text_key="body")


def test_plain_text_file_hint(tmp_path, tok):
    f = tmp_path / "notes.txt"
    f.write_text("just some prose\n")
    with pytest.raises(UserError, match=r"notes\.txt line 1 is not valid JSON.*pass a directory"):
        load_samples(f, tok)


def test_chat_template_failure_is_user_error(tmp_path):
    class NoTemplate:
        has_chat_template = False

    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    with pytest.raises(UserError, match=r"c\.jsonl line 1: 'messages' needs a chat template"):
        load_samples(f, NoTemplate())

    class Raising:
        def apply_chat_template(self, messages, tokenize=True):
            raise ValueError("Conversation roles must alternate\nuser/assistant")

    expected = r"c\.jsonl line 1: the tokenizer's chat template failed .*alternate user/assistant"
    with pytest.raises(UserError, match=expected):
        load_samples(f, Raising())


def test_invalid_utf8_line(tmp_path, tok):
    f = tmp_path / "u.jsonl"
    f.write_bytes(b'{"content": "ok"}\n{"content": "\xff\xfe"}\n')
    with pytest.raises(UserError, match=r"u\.jsonl line 2: not valid UTF-8"):
        load_samples(f, tok)


def test_one_byte_rule_for_jsonl_lines_and_directory_files(tmp_path, tok):
    """Invalid UTF-8 is refused in a directory's text file as in a JSONL line (it used to be replaced silently); a
    byte-order mark is dropped from both."""
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "bom.txt").write_bytes(b"\xef\xbb\xbfhello there")
    assert load_samples(d, tok) == [enc(tok, "hello there")]
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"content": "hello there"}\n')
    assert load_samples(tmp_path / "bom.jsonl", tok) == [enc(tok, "hello there")]
    (d / "latin1.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1\.txt: not valid UTF-8 \(invalid continuation byte at byte 3\)"):
        load_samples(d, tok)


def test_sample_byte_limit_is_exact_and_checked_for_unchosen_samples(tmp_path, tok, monkeypatch):
    import mlx_fun.datasets.samples as data

    monkeypatch.setattr(data, "MAX_SAMPLE_BYTES", 40)
    fits, over = json.dumps({"content": "x" * 25}), json.dumps({"content": "x" * 26})  # 40 and 41 bytes
    f = write_jsonl(tmp_path / "lines.jsonl", [fits, fits, fits])
    assert len(load_samples(f, tok)) == 3
    write_jsonl(f, [fits] * 20 + [over])
    for _ in range(3):  # the long line is found whichever lines are chosen
        with pytest.raises(UserError, match=r"lines\.jsonl line 21 is longer than 0 MiB, the most one sample may"):
            load_samples(f, tok, max_samples=1)
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text("y" * 40)
    assert load_samples(d, tok) == [enc(tok, "y" * 40)]
    (d / "b.txt").write_text("y" * 41)
    with pytest.raises(UserError, match=r"b\.txt is 0\.0 MiB, over the 0 MiB one sample may take; split it"):
        load_samples(d, tok, max_samples=1, seed=0)


def test_directory_special_files_are_refused_not_skipped_or_read(tmp_path, tok):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text("fine")
    (d / "gone.txt").symlink_to(tmp_path / "missing.txt")
    with pytest.raises(UserError, match=r"cannot read .*gone\.txt \(No such file or directory\); fix it or remove it from the dataset"):
        load_samples(d, tok)
    (d / "gone.txt").unlink()
    os.mkfifo(d / "pipe.txt")
    with pytest.raises(UserError, match=r"pipe\.txt is a FIFO \(named pipe\), not a regular file"):
        load_samples(d, tok)
    with pytest.raises(UserError, match=r"dataset /dev/null is a character device, not a regular file"):
        load_samples("/dev/null", tok)


def test_bad_limits(many, tok):
    with pytest.raises(UserError, match="max_samples="):
        load_samples(many, tok, max_samples=0)
    with pytest.raises(UserError, match="max_tokens="):
        load_samples(many, tok, max_tokens=0)


# --------------------------------------------------------------------------------------------- batches


def test_iter_batches_padding_lengths_coverage():
    samples = [[1, 2], [3, 4, 5, 6, 7], [8], [9, 10, 11], [12, 13, 14, 15], [16, 17]]
    batches = list(iter_batches(samples, 4, pad_id=-1))
    assert len(batches) == 2
    (t0, l0), (t1, l1) = batches
    assert t0.dtype == np.int32 and l0.dtype == np.int32
    assert t0.shape == (4, 5) and t1.shape == (2, 2)
    assert l0.tolist() == [5, 4, 3, 2] and l1.tolist() == [2, 1]
    np.testing.assert_array_equal(
        t0,
        [[3, 4, 5, 6, 7], [12, 13, 14, 15, -1], [9, 10, 11, -1, -1], [1, 2, -1, -1, -1]],
    )
    # ties keep their order: [1, 2] (index 0) before [16, 17] (index 5)
    np.testing.assert_array_equal(t1, [[16, 17], [8, -1]])

    # every sample exactly once, padding only beyond each length
    seen = []
    for tokens, lengths in iter_batches(samples, 3):
        for row, n in zip(tokens, lengths):
            seen.append(row[:n].tolist())
            assert (row[n:] == 0).all()
    assert sorted(seen) == sorted(samples)
    assert count_tokens(samples) == 17 == sum(int(l.sum()) for _, l in iter_batches(samples, 2))


def test_iter_batches_edge_cases():
    assert list(iter_batches([], 4)) == []
    out = list(iter_batches([[7, 8, 9]], 8))
    assert len(out) == 1 and out[0][0].tolist() == [[7, 8, 9]] and out[0][1].tolist() == [3]
    # batch size 1: no padding at all
    for tokens, lengths in iter_batches([[1], [2, 3], np.array([4, 5, 6])], 1):
        assert tokens.shape == (1, int(lengths[0]))
    # empty samples are skipped
    out = list(iter_batches([[], [1, 2], []], 2))
    assert len(out) == 1 and out[0][1].tolist() == [2]
    with pytest.raises(UserError, match="batch_size="):
        list(iter_batches([[1]], 0))
    assert count_tokens([]) == 0


def test_real_dataset_into_batches(tmp_path, tok):
    rows = [{"messages": CHAT}, {"content": "Hello world!"}, {"prompt": "a", "completion": "b"}]
    f = write_jsonl(tmp_path / "r.jsonl", rows)
    samples = load_samples(f, tok)
    pad = tok.pad_token_id
    got = []
    for tokens, lengths in iter_batches(samples, 2, pad_id=pad):
        got.extend(tokens[i, : lengths[i]].tolist() for i in range(len(lengths)))
    assert sorted(got) == sorted(samples)
    assert count_tokens(samples) == sum(len(s) for s in samples) > 0
