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
