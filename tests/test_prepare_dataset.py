"""scripts/prepare_dataset.py --source all: builds every source installed here and says which optional sources it
skipped, why, and how to install them (issue 29 row 23: they were skipped silently)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mlx_fun import corpus

ROOT = Path(__file__).resolve().parents[1]


def test_source_all_names_every_skipped_source_with_why_and_how_to_install(tmp_path):
    missing = tmp_path / "no-such-package.tgz"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_dataset.py"), "--source", "all", "--output",
                        str(tmp_path / "c"), "--split", "test", "--max-eval-samples", "2", "--openzeppelin",
                        str(missing), "--max-package-bytes", "20000"], capture_output=True, text=True, timeout=300)
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
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_dataset.py"), "--source", "code",
                            "--split", "test", "--max-eval-samples", "2", "--output", str(out), *extra],
                           capture_output=True, text=True, timeout=300)
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
