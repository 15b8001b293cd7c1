"""`python -m scripts.tools.prepare_dataset --source all`: builds every source installed here and says which optional
sources it skipped, why, and how to install them (issue 29 row 23: they were skipped silently)."""

from __future__ import annotations

import json

import pytest

from mlx_fun.datasets import corpus

from .cli_helpers import script


def test_source_all_names_every_skipped_source_with_why_and_how_to_install(tmp_path):
    missing = tmp_path / "no-such-package.tgz"
    r = script("tools.prepare_dataset", "--source", "all", "--output", tmp_path / "c", "--split", "test",
               "--max-eval-samples", "2", "--openzeppelin", missing, "--max-package-bytes", "20000", timeout=300)
    assert r.returncode == 0, r.stderr
    have = corpus.available_sources(str(missing))
    skipped = [line for line in r.stderr.splitlines() if line.startswith("--source all: skipped ")]
    assert [line.split()[3] for line in skipped] == [s for s in corpus.OPTIONAL if not have[s]]
    for line in skipped:
        name = line.split()[3]
        assert line.endswith(f"install: {corpus.INSTALL_HINTS[name]})"), line
        assert ("does not exist" if name == "solidity" else "not installed here") in line, line
    assert f"--source all: skipped solidity (--openzeppelin {missing} does not exist;" in r.stderr
    built = json.loads((tmp_path / "c" / "manifest.json").read_text())["domains"]
    assert sorted(built) == sorted(s for s in corpus.SOURCES if have[s])


def test_a_corpus_file_or_manifest_that_exists_is_replaced_only_with_force(tmp_path):
    """Issue 41 rows 1-2: a hand-edited split file or manifest is refused without --force (one line naming it and
    --force, exit 2, its bytes unchanged, checked before anything is built); a FIFO is refused even with --force;
    with --force the run replaces them."""
    import os
    import stat

    out = tmp_path / "c"
    (out / "code").mkdir(parents=True)
    split, manifest = out / "code" / "test.jsonl", out / "manifest.json"

    def prepare(*extra):
        r = script("tools.prepare_dataset", "--source", "code", "--split", "test", "--max-eval-samples", "2",
                   "--output", out, *extra, timeout=300)
        errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
        return r.returncode, errors, r.stderr

    for existing in (split, manifest):
        existing.write_text('{"content": "hand-edited"}\n')
        before = existing.read_bytes()
        code, errors, err = prepare()
        assert code == 2 and len(errors) == 1, err
        assert f"--output {existing} already exists; pass --force" in errors[0], errors[0]
        assert existing.read_bytes() == before and not [p for p in out.rglob(".*")]
        if existing == split:
            split.unlink()
    os.mkfifo(split)
    code, errors, err = prepare("--force")
    assert code == 2 and len(errors) == 1 and f"{split} is a FIFO" in errors[0], err
    assert stat.S_ISFIFO(split.lstat().st_mode) and manifest.read_text() == '{"content": "hand-edited"}\n'
    split.unlink()
    split.write_text('{"content": "hand-edited"}\n')
    code, errors, err = prepare("--force")
    assert code == 0, err
    assert len(split.read_text().splitlines()) == 2 and "code" in json.loads(manifest.read_text())["domains"]


def _script(*args, timeout=60):
    return script("tools.prepare_dataset", *args, timeout=timeout)


@pytest.mark.parametrize("args, needle", [
    (["--max-samples", "-1"], "--max-samples must be a whole number >= 1, got -1"),
    (["--max-samples", "0"], "--max-samples must be a whole number >= 1, got 0"),  # blamed --min-tokens
    (["--max-eval-samples", "-2"], "--max-eval-samples must be a whole number >= 1"),
    (["--max-chars", "0"], "--max-chars must be a whole number >= 1, got 0"),  # looped forever
    (["--min-tokens", "-1"], "--min-tokens must be a whole number >= 0"),
    (["--seed", "-1"], "--seed must be a whole number >= 0"),
])
def test_a_number_out_of_range_is_one_line_before_any_source_is_read(tmp_path, args, needle):
    r = _script("--source", "code", "--output", tmp_path / "c", *args)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [r.stderr.splitlines()[0]] and r.stderr.startswith(f"Error: {needle}"), r.stderr
    assert not (tmp_path / "c").exists()


def test_an_openzeppelin_file_that_is_no_tar_archive_is_one_line(tmp_path):
    bogus = tmp_path / "contracts.tgz"
    bogus.write_text("not a tarball\n")
    r = _script("--source", "solidity", "--output", tmp_path / "c", "--openzeppelin", bogus)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"Error: --openzeppelin {bogus} is not a tar archive; pass the .tgz"), r.stderr
    assert not (tmp_path / "c").exists()


def test_chunk_text_refuses_a_width_that_cannot_hold_a_character():
    with pytest.raises(ValueError, match="max_chars must be at least 1"):
        corpus.chunk_text("a\n" * 3000, 0)
