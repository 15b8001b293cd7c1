"""Corpus sources from what a machine has installed: packages split whole, man pages as text, Debian docs."""

from __future__ import annotations

import gzip
import json

from mlx_fun.datasets import corpus, corpus_machine

MAN_PAGE = r""".\" Automatically generated
.de Vb \" Begin verbatim text
.ft CW
..
.TH GREP 1 "2024" "GNU" "User Commands"
.SH NAME
grep \- print lines that match patterns
.SH SYNOPSIS
.B grep
[\fIOPTION\fR...] \fIPATTERNS\fR [\fIFILE\fR...]
.SH DESCRIPTION
.PP
\fBgrep\fP searches for \(lqPATTERNS\(rq in each FILE.
.TP
.BR \-i ", " \-\^\-ignore\-case
Ignore case distinctions in patterns and input data.
"""


def test_troff_text_keeps_the_words_and_drops_the_markup():
    text = corpus_machine.troff_text(MAN_PAGE)
    assert "grep - print lines that match patterns" in text
    assert 'grep searches for "PATTERNS" in each FILE.' in text
    assert "Ignore case distinctions in patterns and input data." in text
    assert "-i" in text and "--ignore-case" in text
    for markup in ("\\f", ".TH", ".SH", ".de", "Begin verbatim", ".ft", "\\(", '.\\"'):
        assert markup not in text


def _site(tmp_path, monkeypatch):
    site = tmp_path / "site-packages"
    for pkg in ("alpha", "beta", "gamma", "delta", "mlx_fun"):
        for mod in range(6):
            f = site / pkg / "sub" / f"m{mod}.py"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(f'"""Module {mod} of {pkg}: {"a sentence of documentation. " * 6}"""\n\n'
                         + "\n".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(40)))
        (site / pkg / "__init__.py").write_text("")
        (site / pkg / "tests").mkdir()
        (site / pkg / "tests" / "test_x.py").write_text("assert True\n" * 50)
    (site / "huge").mkdir()
    (site / "huge" / "__init__.py").write_text("x = 1\n" * 100)
    (site / "huge" / "table.py").write_text("x = 1\n" * (corpus_machine.MAX_FILE_BYTES // 4))
    monkeypatch.setattr(corpus_machine, "site_dirs", lambda: [site])
    return site


def test_a_package_lands_in_one_split_tests_and_oversized_files_are_left_out(tmp_path, monkeypatch):
    _site(tmp_path, monkeypatch)
    docs = list(corpus._documents("packages"))
    assert {d.group for d in docs} == {"pkg:alpha", "pkg:beta", "pkg:gamma", "pkg:delta", "pkg:huge"}  # not ours
    assert not any("tests/" in d.doc_id or d.doc_id.endswith("table.py") for d in docs)
    splits = {}
    for d in docs:
        splits.setdefault(d.group, set()).add(corpus.split_of(d.group or d.doc_id))
    assert all(len(s) == 1 for s in splits.values())
    prose = list(corpus._documents("packagedocs"))
    assert {d.group for d in prose} <= {d.group for d in docs}
    assert all("a sentence of documentation." in d.text and "return x" not in d.text for d in prose)


def test_the_per_package_cap_and_the_manifest_name_what_was_read(tmp_path, monkeypatch):
    _site(tmp_path, monkeypatch)
    monkeypatch.setattr(corpus_machine, "MAX_PACKAGE_BYTES", 3000)
    per = {}
    for d in corpus._documents("packages"):
        per[d.group] = per.get(d.group, 0) + len(d.text.encode())
    assert per and max(per.values()) <= 3000
    monkeypatch.setattr(corpus, "split_of", lambda key: {"pkg:alpha": "test", "pkg:beta": "validation"}.get(
        key, "train"))
    manifest = corpus.prepare(tmp_path / "out", sources=["packages"], min_tokens=1)
    read = manifest["domains"]["packages"]["read"]
    assert read["packages"] == ["alpha", "beta", "delta", "gamma", "huge"] and read["max_package_bytes"] == 3000
    test = [json.loads(line)["content"] for line in (tmp_path / "out/packages/test.jsonl").read_text().splitlines()]
    assert test and all("of alpha" in t or "return x" in t for t in test)


def test_man_pages_and_debian_docs_from_their_directories(tmp_path, monkeypatch):
    man = tmp_path / "man"
    (man / "man1").mkdir(parents=True)
    (man / "de" / "man1").mkdir(parents=True)  # a translation: not read
    with gzip.open(man / "man1" / "grep.1.gz", "wt") as f:
        f.write(MAN_PAGE * 3)
    with gzip.open(man / "de" / "man1" / "grep.1.gz", "wt") as f:
        f.write(MAN_PAGE)
    (man / "man1" / "egrep.1").write_text(".so man1/grep.1\n")  # a link page
    pages = list(corpus_machine.man_documents(man))
    assert [p.doc_id for p in pages] == ["man:man1/grep.1.gz"] and pages[0].group == "man:grep"
    doc = tmp_path / "doc"
    (doc / "zstd").mkdir(parents=True)
    with gzip.open(doc / "zstd" / "README.md.gz", "wt") as f:
        f.write("Zstandard is a fast compression algorithm. " * 20)
    (doc / "zstd" / "copyright").write_text("not read")
    (doc / "zstd" / "changelog.Debian.gz").write_bytes(gzip.compress(b"not read either"))
    got = list(corpus_machine.debian_doc_documents(doc))
    assert [(g.doc_id, g.group) for g in got] == [("debdoc:zstd/README.md.gz", "debdoc:zstd")]
    assert got[0].text.startswith("Zstandard is a fast")


def test_a_source_with_an_empty_split_writes_nothing_or_is_skipped_under_all(tmp_path, monkeypatch):
    _site(tmp_path, monkeypatch)
    split_of = corpus.split_of
    monkeypatch.setattr(corpus, "split_of", lambda key: "train" if key.startswith("pkg:") else split_of(key))
    out = tmp_path / "out"
    try:
        corpus.prepare(out, sources=["code", "packages"], min_tokens=1)
    except corpus.UserError as e:
        assert "packages/validation came out empty" in str(e)
    else:
        raise AssertionError("an empty split was written")
    assert not out.exists() or not any(out.rglob("*.jsonl"))  # not even the code domain before it
    said = []
    manifest = corpus.prepare(out, sources=["packages"], min_tokens=1, skip_empty=True, log=said.append)
    assert manifest["domains"] == {} and said == ["skipped packages: its validation, test split(s) came out empty "
                                                  "on this machine"]
