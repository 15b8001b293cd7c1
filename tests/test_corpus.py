"""Offline corpus: document-level splits, chunking, markup stripping, manifest, errors."""

from __future__ import annotations

import hashlib
import json

import pytest

from mlx_fun.datasets import corpus
from mlx_fun.errors import UserError

from .cli_helpers import script


def test_split_is_a_deterministic_hash_of_the_document_id():
    ids = [f"stdlib:mod{i}.py" for i in range(2000)]
    splits = [corpus.split_of(i) for i in ids]
    assert splits == [corpus.split_of(i) for i in ids]
    share = {s: splits.count(s) / len(ids) for s in corpus.SPLITS}
    assert 0.85 < share["train"] < 0.95 and 0.03 < share["test"] < 0.07 and 0.03 < share["validation"] < 0.07
    # the rule itself: first 8 hex digits of sha1, mod 100
    bucket = int(hashlib.sha1(b"stdlib:json/decoder.py").hexdigest()[:8], 16) % 100
    expected = "test" if bucket < 5 else "validation" if bucket < 10 else "train"
    assert corpus.split_of("stdlib:json/decoder.py") == expected


def test_chunk_text_respects_max_chars_and_keeps_all_text():
    paras = [("word " * n).strip() for n in (10, 300, 5, 40, 1000)]
    text = "\n\n".join(paras) + "\n" + "x" * 2500
    chunks = corpus.chunk_text(text, 500)
    assert all(0 < len(c) <= 500 for c in chunks)
    assert "".join(chunks).replace("\n", "").replace(" ", "") == text.replace("\n", "").replace(" ", "")
    assert corpus.chunk_text("short", 500) == ["short"]
    assert corpus.chunk_text("\n\n  \n", 500) == []


def test_strip_rst_keeps_prose_and_drops_markup():
    rst = (":mod:`json` --- JSON encoder\n==========================\n\n.. module:: json\n   :synopsis: x\n\n"
           "Use :func:`json.dumps` with ``indent`` for **pretty** output; see `RFC <https://x>`_.\n")
    out = corpus.strip_rst(rst)
    assert "json --- JSON encoder" in out and "Use json.dumps with indent for pretty output; see RFC." in out
    assert "====" not in out and ".. module" not in out and ":synopsis:" not in out


def test_prepare_writes_splits_and_manifest(tmp_path):
    out = tmp_path / "corpus"
    manifest = corpus.prepare(out, max_samples=20, max_eval_samples=5, max_chars=1024)
    assert set(manifest["domains"]) == {"code", "prose"}
    for domain in ("code", "prose"):
        for split in corpus.SPLITS:
            path = out / domain / f"{split}.jsonl"
            body = path.read_text(encoding="utf-8")
            lines = [json.loads(line) for line in body.splitlines()]
            assert len(lines) == (20 if split == "train" else 5)
            assert all(0 < len(x["content"]) <= 1024 and corpus.approx_tokens(x["content"]) >= 32 for x in lines)
            entry = manifest["domains"][domain]["splits"][split]
            assert entry["samples"] == len(lines) and entry["sha256"] == hashlib.sha256(body.encode()).hexdigest()
            assert entry["available"] >= entry["samples"]
    assert json.loads((out / "manifest.json").read_text()) == manifest
    # held-out prose never comes from a module whose code is trained on: both use the module's path as doc id
    code_train = {d.doc_id for d in corpus.code_documents() if corpus.split_of(d.doc_id) == "train"}
    prose_test = {d.doc_id for d in corpus.prose_documents() if corpus.split_of(d.doc_id) == "test"}
    assert prose_test and any(i.startswith("stdlib:") for i in prose_test) and not (code_train & prose_test)
    # the same settings give the same files
    again = corpus.prepare(tmp_path / "again", max_samples=20, max_eval_samples=5, max_chars=1024)
    assert again["domains"]["code"]["splits"]["test"]["sha256"] == manifest["domains"]["code"]["splits"]["test"]["sha256"]
    assert not list(out.rglob("*.tmp"))


def test_prepare_errors(tmp_path):
    with pytest.raises(UserError, match="unknown source"):
        corpus.prepare(tmp_path / "x", sources=["klingon"])
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        corpus.prepare(tmp_path / "file", max_samples=1, max_eval_samples=1)
    missing = [s for s, ok in corpus.available_sources().items() if not ok]
    if missing:  # only machines without the optional package can check the install hint
        with pytest.raises(UserError, match="not installed"):
            corpus.prepare(tmp_path / "y", sources=[missing[0]])


def test_solidity_from_an_npm_pack_tarball(tmp_path):
    import io
    import tarfile

    tgz = tmp_path / "openzeppelin-contracts-5.0.0.tgz"
    src = "// SPDX-License-Identifier: MIT\npragma solidity ^0.8.20;\n\ncontract Token {\n" + \
          "    uint256 public totalSupply;\n" * 30 + "}\n"
    with tarfile.open(tgz, "w:gz") as tar:
        for i in range(40):
            data = src.replace("Token", f"Token{i}").encode()
            info = tarfile.TarInfo(f"package/token/Token{i}.sol")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    docs = list(corpus.solidity_documents(tgz))
    assert len(docs) == 40 and docs[0].doc_id == "solidity:token/Token0.sol" and "pragma solidity" in docs[0].text
    manifest = corpus.prepare(tmp_path / "c", sources=["solidity"], splits=("train",), openzeppelin=tgz)
    assert manifest["domains"]["solidity"]["splits"]["train"]["samples"] > 20
    # built in worker processes (what scripts/tools/prepare_dataset.py does with several sources): the same samples,
    # in order
    here = corpus.build_domain("solidity", openzeppelin=tgz)
    assert corpus._build_all(["solidity", "solidity"], 2048, 32, tgz, workers=2) == [here, here] and here["train"]


def test_prepare_dataset_script(tmp_path):
    out = tmp_path / "c"
    r = script("tools.prepare_dataset", "--output", out, "--source", "code", "--split", "test",
               "--max-eval-samples", "3")
    assert r.returncode == 0, r.stderr
    assert len((out / "code" / "test.jsonl").read_text().splitlines()) == 3
    assert not (out / "code" / "train.jsonl").exists()
    r = script("tools.prepare_dataset", "--output", out, "--source", "klingon")
    assert r.returncode == 2 and r.stderr.startswith("Error: unknown source")
    r = script("tools.prepare_dataset", "--output", out / "p", "--source", "packages", "--max-package-bytes", "-5")
    assert r.returncode == 2 and r.stderr.startswith("Error: --max-package-bytes must be at least 1, got -5")
    assert not (out / "p").exists()
    r = script("tools.prepare_dataset", "--list")
    assert r.returncode == 0 and r.stdout.splitlines()[0].split()[:2] == ["code", "yes"]


def test_jargon_entries_are_split_into_documents(tmp_path):
    import gzip

    entries = "".join(f"   :term{i}: n.\n\n   Meaning number {i}, with ‘quotes’ and more words.\n\n" for i in range(45))
    path = tmp_path / "jargon.txt.gz"
    with gzip.open(path, "wb") as f:
        f.write(("   The Jargon File, front matter.\n\n" + entries).encode("utf-8"))
    docs = list(corpus.jargon_documents([path]))
    assert [d.doc_id for d in docs] == ["jargon:0:front", "jargon:1:term19", "jargon:2:term39"]
    assert docs[1].text.startswith(":term19: n.\n\nMeaning number 19, with ‘quotes’")
    assert sum(d.text.count(":term") for d in docs) == 45
