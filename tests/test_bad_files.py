"""Bad files handed to any command (issue 29, rows 13-16 and 21): datasets that are devices, FIFOs, endless lines
or binary text; model directories with a malformed config.json or no tokenizer; malformed dispatch tables.

Every case: exit 2, one ``Error:`` line naming the file and the problem, nothing written (no output, temp or lock
left beside it), the inputs unchanged.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from mlx_fun.datasets.samples import MAX_SAMPLE_BYTES

from .cli_helpers import expect_error, run
from .test_nothing_lost import MLX_FUN, SAMPLE, one_error_line, tree

LIMIT = f"{MAX_SAMPLE_BYTES >> 20} MiB"


def bounded(*args, timeout: float = 90, memory: int = 4 << 30):
    """The installed ``mlx-fun ARGS`` in a subprocess held to ``memory`` bytes of address space and killed after
    ``timeout`` seconds: ``(CompletedProcess, seconds, peak RSS in bytes)``. A run that reads a device to its end
    dies here of a MemoryError or the timer instead of taking the machine's memory."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    with tempfile.TemporaryFile() as err:
        start = time.monotonic()
        proc = subprocess.Popen([MLX_FUN, *map(str, args)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err, preexec_fn=limit)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.monotonic() - start
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr), seconds, usage.ru_maxrss * 1024


def everything(path: Path) -> list[str]:
    """Every entry below ``path``, hidden ones (temps, locks) included."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# ------------------------------------------------------------------ row 13: devices, FIFOs, endless lines


def test_dataset_that_is_a_device_or_fifo_is_refused_at_once(tmp_path, qwen_model):
    """`collect --dataset /dev/zero` read until the kernel killed it (~20 GB, exit 137, lock and temp left); a FIFO
    blocked forever; inside a directory a FIFO was skipped silently and a link to /dev/zero read without end."""
    out = tmp_path / "out"
    out.mkdir()
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    with_link, with_fifo = tmp_path / "link", tmp_path / "fifodir"
    for d in (with_link, with_fifo):
        d.mkdir()
        (d / "a.txt").write_text("a fine text file\n")
    (with_link / "zero.txt").symlink_to("/dev/zero")
    os.mkfifo(with_fifo / "pipe.txt")
    cases = [("/dev/zero", "dataset /dev/zero is a character device, not a regular file"),
             (fifo, f"dataset {fifo} is a FIFO (named pipe), not a regular file"),
             (with_link, f"dataset file {with_link / 'zero.txt'} is a character device, not a regular file"),
             (with_fifo, f"dataset file {with_fifo / 'pipe.txt'} is a FIFO (named pipe), not a regular file")]
    for dataset, needle in cases:
        proc, seconds, peak = bounded("collect", "--model", qwen_model, "--dataset", dataset,
                                      "--output", out / "s.npz")
        one_error_line(proc, needle)
        assert seconds < 60 and peak < 1 << 30, (dataset, seconds, peak)
        assert everything(out) == []


def test_jsonl_line_or_directory_file_over_the_limit_is_one_line(tmp_path, qwen_model):
    """A regular file that is one endless line (a sparse 16 MiB + 1 of zero bytes) is refused at the limit, not
    read whole; a directory's file over the limit likewise, before anything is tokenized."""
    out = tmp_path / "out"
    out.mkdir()
    endless = tmp_path / "endless.jsonl"
    with open(endless, "wb") as f:
        f.truncate(MAX_SAMPLE_BYTES + 1)
    big = tmp_path / "big"
    big.mkdir()
    (big / "a.txt").write_text("fine\n")
    with open(big / "b.txt", "wb") as f:
        f.truncate(MAX_SAMPLE_BYTES + 1)
    before = tree(tmp_path)
    expect_error(run("collect", "--model", qwen_model, "--dataset", endless, "--output", out / "s.npz"),
                 f"{endless} line 1 is longer than {LIMIT}, the most one sample may take")
    expect_error(run("collect", "--model", qwen_model, "--dataset", big, "--output", out / "s.npz"),
                 f"dataset file {big / 'b.txt'} is 16.0 MiB, over the {LIMIT} one sample may take")
    assert tree(tmp_path) == before and everything(out) == []


def test_dataset_limit_is_in_the_help():
    res = run("collect", "--help")
    assert res.exit_code == 0 and f"at most {MAX_SAMPLE_BYTES >> 20}" in " ".join(res.output.split())


# ------------------------------------------------------------------ row 14: binary text in a directory


def test_binary_txt_in_a_directory_is_refused_like_the_same_bytes_in_jsonl(tmp_path, qwen_model):
    """Random bytes in `x.txt` became one 2,048-token sample (exit 0) while the same bytes in JSONL were refused
    as non-UTF-8: one rule for both now."""
    import random

    noise = b"\xff" + random.Random(0).randbytes(4095)
    out = tmp_path / "out"
    out.mkdir()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("a fine text file\n")
    (corpus / "noise.txt").write_bytes(noise)
    jsonl = tmp_path / "noise.jsonl"
    jsonl.write_bytes(noise.replace(b"\n", b" ") + b"\n")
    nul = tmp_path / "nul"
    nul.mkdir()
    (nul / "zeros.txt").write_bytes(b"text, then\0\0\0")
    before = tree(tmp_path)
    expect_error(run("collect", "--model", qwen_model, "--dataset", jsonl, "--output", out / "s.npz"),
                 f"{jsonl} line 1: not valid UTF-8 (invalid start byte at byte 0); save the file as UTF-8")
    expect_error(run("collect", "--model", qwen_model, "--dataset", corpus, "--output", out / "s.npz"),
                 f"{corpus / 'noise.txt'}: not valid UTF-8 (invalid start byte at byte 0); save the file as UTF-8")
    expect_error(run("collect", "--model", qwen_model, "--dataset", nul, "--output", out / "s.npz"),
                 f"{nul / 'zeros.txt'}: a NUL byte at byte 10, so not a text file")
    assert tree(tmp_path) == before and everything(out) == []


# ------------------------------------------------------------------ rows 15 and 21: model directories


def _break(path: Path, how: str) -> None:
    cfg = path / "config.json"
    config = json.loads(cfg.read_text())
    if how == "list":
        config = [config]
    elif how == "top_k":
        config["num_experts_per_tok"] = config["num_experts"] + 1
    elif how == "top_k_text":
        config["num_experts_per_tok"] = "2"
    elif how == "missing_key":
        del config["hidden_size"]
    elif how == "text_config":
        config["text_config"] = "qwen"
    elif how == "no_tokenizer":
        for f in path.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")):
                f.unlink()
    cfg.write_text(json.dumps(config))


BROKEN = {
    "list": "config.json holds a list, not a JSON object of model settings",
    "top_k": "config.json: num_experts_per_tok = 9 is more than the 8 routed experts (num_experts)",
    "top_k_text": "config.json: num_experts_per_tok (experts per token) must be a whole number of at least 1, "
                  'got a string "2"',
    "missing_key": "config.json does not describe a qwen3_moe model mlx-lm can build (TypeError: "
                   "ModelArgs.__init__() missing 1 required positional argument: 'hidden_size')",
    "text_config": "config.json: 'text_config' must be an object, got a string",
    "no_tokenizer": "has no tokenizer: none of tokenizer.json, tokenizer.model, vocab.json, vocab.txt",
}


@pytest.fixture(scope="module")
def broken(tmp_path_factory, qwen_model):
    """A copy of the tiny qwen3_moe broken each way of ``BROKEN`` (and a dataset and domain map for the commands)."""
    root = tmp_path_factory.mktemp("broken")
    for how in BROKEN:
        shutil.copytree(qwen_model, root / how)
        _break(root / how, how)
    (root / "data.jsonl").write_text('{"content": "hello world"}\n')
    (root / "domain.json").write_text(json.dumps({"layers": {}}))
    return root


#: every command that takes --model, with its other required arguments (OUT: the output directory)
COMMANDS = {
    "collect": ["--dataset", "DATA", "--output", "OUT/s.npz"],
    "prune": ["--n-prune", 1, "--output", "OUT/pruned"],
    "merge": ["--n-prune", 1, "--dataset", "DATA", "--output", "OUT/merged"],
    "eval": ["--dataset", "DATA", "--output", "OUT/eval.json"],
    "smoke-test": ["--max-tokens", 2],
    "safety-scan": ["--harmful-dataset", "DATA", "--benign-dataset", "DATA", "--output", "OUT/r.json"],
    "domain-scan": ["--domain-dataset", "DATA", "--general-dataset", "DATA", "--domain-name", "x",
                    "--output", "OUT/r.json"],
    "abliterate": ["--harmful-dataset", "DATA", "--benign-dataset", "DATA", "--output", "OUT/abl"],
    "amplify": ["--domain-map", "MAP", "--output", "OUT/amp"],
    "quantize": ["--output", "OUT/q"],
    "steer": ["--prompt", "hello", "--max-tokens", 2],
    "tune-dispatch": ["--ms", "1", "--output", "OUT/t.json"],
    "serve": ["--port", 0],
}


@pytest.mark.parametrize("how", sorted(BROKEN))
def test_every_command_refuses_a_broken_model_directory_in_one_line(tmp_path, broken, how):
    """A config.json with top-k above the expert count ended smoke-test in `internal error ValueError:
    [argpartition]`, one that is a JSON list safety-scan in `internal error AttributeError`; a model without
    tokenizer files in "the prompt encodes to no tokens". Now one check, before anything loads, for every command."""
    model = broken / how
    before = tree(broken)
    for command, extra in COMMANDS.items():
        out = tmp_path / command
        out.mkdir()
        subst = {"DATA": broken / "data.jsonl", "MAP": broken / "domain.json"}
        args = [subst.get(a, a) if not str(a).startswith("OUT/") else out / str(a)[4:] for a in extra]
        res = run(command, "--model", model, *args)
        expect_error(res, str(model), BROKEN[how])
        assert everything(out) == [], command
    assert tree(broken) == before


def test_load_model_names_the_missing_tokenizer(broken):
    """Every loader goes through io.load_model: it says the tokenizer is missing (before mlx-lm loads an empty one)."""
    from mlx_fun.errors import UserError
    from mlx_fun.model.io import check_tokenizer, load_model

    with pytest.raises(UserError, match=f"{broken / 'no_tokenizer'} has no tokenizer: none of tokenizer.json"):
        load_model(broken / "no_tokenizer")
    sentencepiece = broken.parent / "spm"
    sentencepiece.mkdir(exist_ok=True)
    (sentencepiece / "spiece.model").write_bytes(b"x")
    check_tokenizer(sentencepiece)  # a sentencepiece (or tiktoken) vocabulary counts


# ------------------------------------------------------------------ row 16: dispatch tables


TABLES = {
    '{"entries": "x"}': "is malformed: 'entries' must be a list of entries, got a string \"x\"",
    "[1, 2]": "is malformed: the table must be a JSON object",
    "not json": "is not valid JSON (Expecting value at line 1, column 1)",
    '{"entries": [5]}': "is malformed: entries[0] must be an object (backend, quant, D, H, E, k, bands), got a number",
    '{"entries": [{"backend": "cpu"}]}': "is malformed: entries[0] has no 'quant', 'D', 'H', 'E', 'k', 'bands'",
    '{"entries": [{"backend": "cpu", "quant": "float32", "D": 8, "H": 8, "E": 4, "k": "2", "bands": []}]}':
        "is malformed: entries[0].k must be a whole number >= 1, got a string \"2\"",
    '{"entries": [{"backend": "cpu", "quant": "float32", "D": 8, "H": 8, "E": 4, "k": 2, "bands": {}}]}':
        "is malformed: entries[0].bands must be a list of {\"from\": M, \"plan\": ...} bands, got an object",
    '{"entries": [{"backend": "cpu", "quant": "float32", "D": 8, "H": 8, "E": 4, "k": 2, '
    '"bands": [{"from": 1, "plan": 3}]}]}': "is malformed: entries[0].bands[0].plan must be a string, got a number",
}


@pytest.mark.parametrize("text", list(TABLES))
def test_malformed_dispatch_table_is_one_line_naming_the_file(tmp_path, qwen_model, text, monkeypatch):
    """`--dispatch-table` holding `{"entries": "x"}` was an internal AttributeError; the user table in the cache
    directory is checked the same way, with its own fix."""
    monkeypatch.setenv("MLX_FUN_DISPATCH_TABLE", str(tmp_path / "no-user-table.json"))
    table = tmp_path / "t.json"
    table.write_text(text)
    out = tmp_path / "out"
    out.mkdir()
    expect_error(run("collect", "--model", qwen_model, "--dataset", SAMPLE, "--output", out / "s.npz",
                     "--max-samples", 1, "--dispatch-table", table),
                 f"dispatch table {table} {TABLES[text]}", "; fix the file or drop --dispatch-table.")
    assert everything(out) == [] and table.read_text() == text
    monkeypatch.setenv("MLX_FUN_DISPATCH_TABLE", str(table))
    expect_error(run("smoke-test", "--model", qwen_model, "--max-tokens", 2),
                 f"dispatch table {table} {TABLES[text]}", "; fix or delete this user table")
    assert table.read_text() == text
