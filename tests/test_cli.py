"""The command line: help texts, `collect` end to end, and every error path of `collect`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mlx_fun.observe.saliency import SaliencyAccumulator
from .cli_helpers import expect_error as _error, run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "data" / "calibration_sample.jsonl"




def test_help_lists_every_command_with_one_line():
    result = run("--help")
    assert result.exit_code == 0
    for name in ("collect", "stats-diff", "stats-merge", "stats-purge", "doctor"):
        lines = [line for line in result.output.splitlines() if line.strip().startswith(name + " ")]
        assert len(lines) == 1 and len(lines[0].split(None, 1)[1]) > 10, name


def test_version():
    result = run("--version")
    assert result.exit_code == 0 and result.output.startswith("mlx-fun 0.")
    assert "blas:" in result.output


def test_collect_help_explains_flags():
    result = run("collect", "--help")
    assert result.exit_code == 0
    for flag in ("--model", "--dataset", "--output", "--max-samples", "--max-tokens", "--text-key", "--seed",
                 "--batch-size"):
        assert flag in result.output
    assert "Example" in result.output and "messages" in result.output


def test_collect_end_to_end(tmp_path, make_model):
    model = make_model("qwen3_moe", bits=4)
    out = tmp_path / "sub" / "saliency.npz"
    result = run("collect", "--model", model, "--dataset", SAMPLE, "--output", out, "--max-samples", 10,
                 "--seed", 3, "--batch-size", 4, "--max-tokens", 64)
    assert result.exit_code == 0, result.output
    assert "Wrote" in result.output and "tok/s" in result.output
    acc = SaliencyAccumulator.load(out)
    assert acc.model_type == "qwen3_moe" and acc.num_experts == 8 and acc.moe_layer_indices == [0, 1]
    np.testing.assert_array_equal(acc.freq.sum(axis=1), acc.total_tokens * 2)
    assert acc.total_tokens > 100 and acc.has_norms
    # same seed, same subset → identical statistics
    out2 = tmp_path / "again.npz"
    run("collect", "--model", model, "--dataset", SAMPLE, "--output", out2, "--max-samples", 10, "--seed", 3,
        "--batch-size", 1, "--max-tokens", 64)
    np.testing.assert_array_equal(SaliencyAccumulator.load(out2).freq, acc.freq)




def test_collect_errors(tmp_path, make_model):
    model = make_model("mixtral")
    out = tmp_path / "s.npz"
    _error(run("collect", "--model", tmp_path / "nope", "--dataset", SAMPLE, "--output", out),
           "does not exist", "--model")
    _error(run("collect", "--model", tmp_path, "--dataset", SAMPLE, "--output", out), "no config.json")
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _error(run("collect", "--model", llama, "--dataset", SAMPLE, "--output", out), "not supported", "qwen3_moe")
    _error(run("collect", "--model", model, "--dataset", tmp_path / "missing.jsonl", "--output", out),
           "does not exist")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": "fine"}\n{"content": "broken"\n')
    _error(run("collect", "--model", model, "--dataset", bad, "--output", out), "bad.jsonl", "line 2")
    _error(run("collect", "--model", model, "--dataset", SAMPLE, "--output", tmp_path), "is a directory")
    assert not out.exists() and not list(tmp_path.glob(".s.npz*"))


def test_console_script_collect_help():
    result = subprocess.run([sys.executable, "-m", "mlx_fun", "collect", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "--batch-size" in result.stdout


@pytest.mark.parametrize("bad_args,needle", [(["--max-samples", "0"], "--max-samples"),
                                             (["--batch-size", "0"], "--batch-size")])
def test_collect_rejects_bad_numbers(tmp_path, bad_args, needle):
    result = run("collect", "--model", tmp_path, "--dataset", SAMPLE, "--output", tmp_path / "x.npz", *bad_args)
    assert result.exit_code == 2 and needle in result.output
