"""The command line: help texts, `collect` end to end, and every error path of `collect`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mlx_fun.saliency import SaliencyAccumulator
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


def test_readme_python_api_runs(tmp_path, monkeypatch, capsys):
    """The README's Python examples run as written: the jobs (collect → prune / merge → eval → smoke-test, the
    CLI's own functions) and the library pipeline (load → hooks → accumulate → select → prune → save)."""
    import re
    import shutil

    readme = (ROOT / "README.md").read_text()
    section = re.search(r"## Python API\n(.*?)\n## ", readme, re.S).group(1)
    codes = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(codes) == 2
    shutil.copytree(ROOT / "data" / "tiny-moe", tmp_path / "data" / "tiny-moe")
    shutil.copy(SAMPLE, tmp_path / "data" / SAMPLE.name)
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(codes[0], "README.md", "exec"), ns)
    printed = capsys.readouterr().out.splitlines()
    got, report = ns["got"], ns["report"]
    assert printed[0] == f"{got.tokens} tokens; (4, 32)" and got.tokens > 500
    assert float(printed[1].split()[0]) == report.results["calibration_sample"]["kl"] > 0
    assert ns["text"].strip() and "\n".join(printed[2:]) == ns["text"].rstrip("\n")
    assert ns["merged"].kept == 24 and ns["pruned"].kept == 24
    assert SaliencyAccumulator.load(tmp_path / "saliency.npz").total_tokens == got.tokens
    for out in ("pruned", "merged"):
        assert json.loads((tmp_path / out / "config.json").read_text())["num_experts"] == 24
    exec(compile(codes[1], "README.md", "exec"), {})
    acc = SaliencyAccumulator.load(tmp_path / "saliency.npz")
    assert acc.scores("reap").shape == (4, 32) and acc.freq.sum() > 0
    import mlx_lm

    pruned, _ = mlx_lm.load(str(tmp_path / "my-pruned"))
    assert json.loads((tmp_path / "my-pruned" / "config.json").read_text())["num_experts"] == 24
    assert pruned.layers[0].mlp.switch_mlp.up_proj.weight.shape[0] == 24
