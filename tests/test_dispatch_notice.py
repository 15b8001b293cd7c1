"""A first run on a backend without a measured dispatch table says so once per machine (issue 32, part 4); every
model command says how its experts run in words, `doctor --model` shows the table entries (issue 44)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_fun.dispatch import table as dispatch_table
from mlx_fun.dispatch.table import Table

from .cli_helpers import run as cli

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "calibration_sample.jsonl"
LINE = "no measured cut-offs for cpu yet"


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A fresh machine: its own cache root, no user table."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv(dispatch_table.TABLE_ENV, str(tmp_path / "cache" / "no-user-table.json"))
    return tmp_path


def collect(model, out: Path):
    result = cli("collect", "--model", model, "--dataset", DATA, "--max-samples", "1", "--max-tokens", "8",
                 "--output", out)
    assert result.exit_code == 0, result.output
    return result


def test_the_first_model_command_without_an_entry_for_the_backend_says_so_once(machine, qwen_model, monkeypatch):
    monkeypatch.setattr(dispatch_table, "shipped_table", lambda: Table(sources=["shipped"]))
    first = collect(qwen_model, machine / "a.npz")
    assert first.stderr.count(LINE) == 1 and "mlx-fun tune-dispatch --model" in first.stderr
    second = collect(qwen_model, machine / "b.npz")
    assert LINE not in second.stderr
    assert (machine / "cache" / "mlx-fun" / "untuned-cpu.told").is_file()
    doctor = cli("doctor")
    assert doctor.exit_code == 0 and LINE in doctor.output  # doctor says it every time


def test_a_backend_with_measured_entries_says_nothing(machine, qwen_model):
    result = collect(qwen_model, machine / "a.npz")
    assert LINE not in result.stderr and "no cpu entry" not in result.stderr
    doctor = cli("doctor")
    assert "measured entries for cpu (shipped)" in doctor.output


def test_an_unwritable_cache_keeps_quiet_rather_than_repeating(machine, qwen_model, monkeypatch):
    monkeypatch.setattr(dispatch_table, "shipped_table", lambda: Table(sources=["shipped"]))
    (machine / "cache").write_text("a file where the cache directory would be")
    assert LINE not in collect(qwen_model, machine / "a.npz").stderr


def test_the_dispatch_line_is_in_words_and_doctor_shows_the_entries(machine, qwen_model):
    """Issue 44: every model command printed `dispatch: auto on cpu, 2 expert layer(s); float32 D64 H32 E8: nearest
    entry float32 D256 H48 E32 k4 (shipped)`; now a line a user reads, the internal one in `doctor --model`."""
    import re

    line = next(ln for ln in collect(qwen_model, machine / "a.npz").stderr.splitlines() if "dispatch" in ln)
    assert line == "experts: runtime dispatch on cpu, tuned for a similar expert shape (shipped table)", line
    doctor = cli("doctor", "--model", qwen_model)
    assert doctor.exit_code == 0, doctor.output
    (full,) = [ln for ln in doctor.output.splitlines() if ln.startswith("dispatch: ")]
    assert re.fullmatch(r"dispatch: auto on cpu, 2 expert layer\(s\); float32 D\d+ H\d+ E8: nearest entry float32 "
                        r"D\d+ H\d+ E\d+ k\d+ \(shipped\)", full), full
    plain = cli("collect", "--model", qwen_model, "--dataset", DATA, "--max-samples", "1", "--max-tokens", "8",
                "--output", machine / "b.npz", "--dispatch", "mlx-lm")
    assert "experts: mlx-lm's own dispatch (--dispatch mlx-lm)" in plain.stderr
