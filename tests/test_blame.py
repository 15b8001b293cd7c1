"""Messages that name what is actually wrong (issue 41, row 14: the config counts and the BLAS switches).

A config.json with ``num_experts: 0`` or ``num_hidden_layers: 0`` was "an interrupted download", ``hidden_size: 0``
an internal ZeroDivisionError; ``MLX_FUN_BLAS`` naming a directory, ``/dev/zero`` or ``WHEEL`` "did not exist";
``OPENBLAS_NUM_THREADS=abc`` (which OpenBLAS ignores) silently turned the thread governor off.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from mlx_fun.runtime import blas
from mlx_fun.datasets.samples import MAX_COUNT
from mlx_fun.runtime.openblas_wheel import cache_dir as blas_cache

from .cli_helpers import expect_error, run as cli
from .test_blas import REEXEC, clean_env, linux_only, needs_openblas

WHOLE = f"must be a whole number from 1 to {MAX_COUNT:,}, got"
EXPERTS = f"num_experts (the routed-expert count) must be a whole number from 0 (a dense checkpoint) to {MAX_COUNT:,}"
#: (key, value) → what the one line says about it (the tiny qwen3_moe's keys)
CONFIGS = [
    ("num_experts", 0, "config.json does not describe the weights beside it (it sets num_experts = 0: a dense model)"),
    ("num_experts", "E-1", "config.json does not describe the weights beside it; fix config.json or re-download"),
    ("num_experts", 1e30, f"{EXPERTS}, got a number 1e+30"),
    ("num_experts", 10**30, f"{EXPERTS}, got a number {10**30}"),
    ("num_experts", -4, f"{EXPERTS}, got a number -4"),
    ("num_experts", 7.5, f"{EXPERTS}, got a number 7.5"),
    ("num_experts", True, f"{EXPERTS}, got a boolean true"),
    ("num_experts", "8", f'{EXPERTS}, got a string "8"'),
    ("num_experts_per_tok", "E+1", "is more than the"),
    ("num_experts_per_tok", 0, "num_experts_per_tok (experts per token) must be a whole number of at least 1"),
    ("num_hidden_layers", 0, f"num_hidden_layers {WHOLE} a number 0"),
    ("num_hidden_layers", 1e30, f"num_hidden_layers {WHOLE} a number 1e+30"),
    ("num_hidden_layers", "4", f'num_hidden_layers {WHOLE} a string "4"'),
    ("hidden_size", 0, f"hidden_size {WHOLE} a number 0"),
    ("num_attention_heads", 0, f"num_attention_heads {WHOLE} a number 0"),
    ("vocab_size", -1, f"vocab_size {WHOLE} a number -1"),
    ("head_dim", 2**40, f"head_dim {WHOLE} a number {2**40}"),
]


@pytest.mark.parametrize("key, value, needle", CONFIGS, ids=[f"{k}={v}" for k, v, _ in CONFIGS])
def test_a_config_count_out_of_range_is_named_not_blamed_on_the_download(key, value, needle, tmp_path, qwen_model):
    model = tmp_path / "model"
    shutil.copytree(qwen_model, model)
    config = json.loads((model / "config.json").read_text())
    experts = config["num_experts"]
    config[key] = {"E-1": experts - 1, "E+1": experts + 1}.get(value, value) if isinstance(value, str) else value
    (model / "config.json").write_text(json.dumps(config))
    before = (model / "config.json").read_bytes()
    result = cli("smoke-test", "--model", model, "--max-tokens", 1)
    expect_error(result, needle)
    line = next(ln for ln in result.output.splitlines() if ln.startswith("Error:"))
    assert "interrupted download" not in line and "internal error" not in line
    assert str(model) in line and (model / "config.json").read_bytes() == before


# ---------------------------------------------------------------------------------------------- MLX_FUN_BLAS
@linux_only
def test_mlx_fun_blas_says_what_the_path_is_and_takes_wheel_in_any_case(tmp_path, monkeypatch):
    monkeypatch.setattr(blas, "_platform", lambda: "linux")
    takes = "(MLX_FUN_BLAS takes the path of a BLAS library file (libopenblas.so.0, ...) or `wheel`)"
    for value, what in ((tmp_path, "is a directory, not a library file"),
                        ("/dev/zero", "is a character device, not a library file"),
                        (tmp_path / "missing.so", "does not exist")):
        monkeypatch.setenv("MLX_FUN_BLAS", str(value))
        notes = []
        blas.find_fast_blas(notes)
        assert notes[0] == f"MLX_FUN_BLAS={value} {what} {takes}; using the next fast BLAS found instead.", notes
    for value in ("WHEEL", " Wheel "):
        monkeypatch.setenv("MLX_FUN_BLAS", value)
        notes = []
        found = blas.find_fast_blas(notes)
        assert not [n for n in notes if "MLX_FUN_BLAS" in n], notes
        if found is not None:
            assert os.path.dirname(found) == str(blas_cache())


@linux_only
@needs_openblas
def test_mlx_fun_blas_naming_a_directory_is_one_warning_and_the_next_blas(tmp_path):
    proc = subprocess.run([sys.executable, "-c", f"{REEXEC}; print('after', flush=True)"],
                          env=clean_env(MLX_FUN_BLAS=str(tmp_path)), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.splitlines() == ["after"], proc.stderr
    warning = [ln for ln in proc.stderr.splitlines() if ln.startswith("mlx-fun: warning:")]
    assert len(warning) == 1 and f"MLX_FUN_BLAS={tmp_path} is a directory, not a library file" in warning[0]


# ------------------------------------------------------------------------------------- OPENBLAS_NUM_THREADS
GOVERNED = f"{REEXEC}; from mlx_fun.runtime import blas_threads; print('governed', blas_threads.running() is not None)"


@linux_only
@needs_openblas
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the governor runs only with 2 or more OpenBLAS threads")
@pytest.mark.parametrize("value, governed, warned", [("abc", True, True), ("0", True, True), ("  ", True, False),
                                                     ("2", False, False)])
def test_an_openblas_thread_count_openblas_ignores_is_said_and_governed(value, governed, warned):
    """OpenBLAS ignores a value that is no count (one thread per core); so does the governor now, and one line on
    stderr says so. A count the user set is kept, as before."""
    proc = subprocess.run([sys.executable, "-c", GOVERNED], env=clean_env(OPENBLAS_NUM_THREADS=value),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["governed", str(governed)], proc.stdout + proc.stderr
    warning = [ln for ln in proc.stderr.splitlines() if ln.startswith("mlx-fun: warning:")]
    assert len(warning) == int(warned), proc.stderr
    if warned:
        assert f"OPENBLAS_NUM_THREADS={value.strip()!r} is not a whole number of threads >= 1" in warning[0]
        assert "governor runs as if it were unset" in warning[0]
