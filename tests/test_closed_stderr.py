"""A closed or full stderr never fails a run (issue 41 row 11): `mlx-fun prune ... 2>&-` and `quantize ...
2>/dev/full` exited 1 with nothing written, because a progress bar or a status line could not be written. Every
command's stderr is spared in one place (:func:`mlx_fun.cli.common.sparing_stderr`): the run completes, writes its
output and exits 0; a bad input still exits 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .cli_helpers import python_path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "data" / "tiny-moe"


def _mlx_fun(*args, stderr: str):
    """``python -m mlx_fun ARGS`` with descriptor 2 closed (``closed``) or on /dev/full (``full``)."""
    env = {**os.environ, "PYTHONPATH": python_path()}
    cmd = [sys.executable, "-m", "mlx_fun", *map(str, args)]
    if stderr == "closed":
        return subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, timeout=300,
                              preexec_fn=lambda: os.close(2))
    with open("/dev/full", "w") as full:
        return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=full, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def saliency(tmp_path_factory):
    from mlx_fun import jobs

    out = tmp_path_factory.mktemp("sal") / "s.npz"
    jobs.collect.run(model=MODEL, dataset=ROOT / "data" / "calibration_sample.jsonl", output=out, max_samples=2,
                     max_tokens=16)
    return out


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("stderr", ["closed", "full"])
def test_prune_and_quantize_complete_without_a_writable_stderr(tmp_path, saliency, stderr):
    runs = {"prune": ["--saliency", saliency, "--n-prune", "8"], "quantize": ["--expert-bits", "4"]}
    for cmd, extra in runs.items():
        out = tmp_path / cmd
        got = _mlx_fun(cmd, "--model", MODEL, *extra, "--output", out, stderr=stderr)
        assert got.returncode == 0, (cmd, got.stdout)
        assert f"Wrote {out}" in got.stdout and (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    bad = _mlx_fun("quantize", "--model", MODEL, "--expert-bits", "9", "--output", tmp_path / "bad", stderr=stderr)
    assert bad.returncode == 2 and not (tmp_path / "bad").exists()
