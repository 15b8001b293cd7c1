"""Every dispatch plan parameter is checked against its range (issue 41, row 6).

A table (``--dispatch-table``, or the user table ``$MLX_FUN_DISPATCH_TABLE``) whose plan was ``blocked1000000``
passed validation, and smoke-test then grew to 7.4 GB in 24 s padding every expert's rows to a million. The one
parameterised plan is ``blocked<R>`` (also after ``dequant:``), in bands and in cached bands; ``tune-dispatch
--blocks`` names the same R.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlx_fun.dispatch.table import BLOCK_RANGE

from .cli_helpers import expect_error, run as cli

SAMPLE = Path(__file__).resolve().parent.parent / "data" / "calibration_sample.jsonl"
OUT_OF_RANGE = ["blocked1000000", "dequant:blocked1000000", f"blocked{BLOCK_RANGE[1] + 1}",
                f"dequant:blocked{BLOCK_RANGE[1] * 2}"]


def _table(path, plan: str, field: str):
    bands = [{"from": 1, "plan": "sorted"}, {"from": 8, "plan": plan}]
    entry = {"backend": "metal", "quant": "float32", "D": 64, "H": 32, "E": 8, "k": 2,  # never this machine's
             "bands": bands if field == "bands" else [{"from": 1, "plan": "sorted"}]}
    if field == "bands_cached":
        entry["bands_cached"] = bands
    path.write_text(json.dumps({"version": 1, "entries": [entry]}))
    return path.read_bytes()


@pytest.mark.parametrize("field", ["bands", "bands_cached"])
@pytest.mark.parametrize("plan", OUT_OF_RANGE)
def test_a_plan_out_of_range_is_refused_from_the_flag_and_the_user_table(plan, field, tmp_path, qwen_model,
                                                                           monkeypatch):
    low, high = BLOCK_RANGE
    table = tmp_path / "t.json"
    before = _table(table, plan, field)
    where = f"dispatch table {table} is malformed: entries[0].{field}[1].plan: {plan!r} has blocks of R ="
    needs = (where, f"blocked<R> takes R from {low} to {high}")
    monkeypatch.setenv("MLX_FUN_DISPATCH_TABLE", str(tmp_path / "no-user-table.json"))
    expect_error(cli("smoke-test", "--model", qwen_model, "--max-tokens", 1, "--dispatch-table", table),
                 *needs, "; fix the file or drop --dispatch-table.")
    out = tmp_path / "out"
    out.mkdir()
    expect_error(cli("collect", "--model", qwen_model, "--dataset", SAMPLE, "--max-samples",
                     1, "--output", out / "s.npz", "--dispatch-table", table), *needs)
    monkeypatch.setenv("MLX_FUN_DISPATCH_TABLE", str(table))
    expect_error(cli("smoke-test", "--model", qwen_model, "--max-tokens", 1), *needs, "; fix or delete this user table")
    assert table.read_bytes() == before and list(out.iterdir()) == []


@pytest.mark.parametrize("blocks", ["1000000", f"8,{BLOCK_RANGE[1] + 1}", f"4,{BLOCK_RANGE[1] * 2}"])
def test_tune_dispatch_blocks_out_of_range_are_refused_before_measuring(blocks, tmp_path, qwen_model):
    low, high = BLOCK_RANGE
    out = tmp_path / "t.json"
    bad = next(int(b) for b in blocks.split(",") if not low <= int(b) <= high)
    result = cli("tune-dispatch", "--model", qwen_model, "--blocks", blocks, "--ms", "1", "--output", out)
    expect_error(result, f"--blocks: a block size must be {low} to {high} rows", f"got {bad}.")
    assert "Device:" not in result.output and not out.exists()


def test_every_plan_in_range_still_parses():
    from mlx_fun.dispatch.table import Plan

    low, high = BLOCK_RANGE
    for text in ("mlx-lm", "unsorted", "sorted", "dequant:unsorted", "dequant:sorted", f"blocked{low}",
                 f"blocked{high}", f"dequant:blocked{high}"):
        assert str(Plan.parse(text)) == text
