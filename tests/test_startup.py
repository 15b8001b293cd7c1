"""A command pays only for what it uses (issue 32, part 1): no command imports PyTorch, even where it is installed,
and the commands that never tokenize do not import transformers at all (:mod:`mlx_fun.runtime.lean_imports`).

Each command runs in a fresh interpreter through the console entry point (``mlx_fun.launcher.main``) with a stub
``torch`` package first on ``sys.path`` that raises on import: a command that imports PyTorch fails. At exit the
process reports which of ``torch`` / ``transformers`` it imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_fun import jobs

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "calibration_sample.jsonl"

PROBE = """
import atexit, json, sys
def report():
    t = sys.modules.get("torch")
    print("MODULES=" + json.dumps({"torch": t is not None, "transformers": sys.modules.get("transformers") is not None}),
          file=sys.stderr)
atexit.register(report)
sys.argv = ["mlx-fun"] + sys.argv[1:]
from mlx_fun.launcher import main
main()
"""


@pytest.fixture(scope="module")
def stub_torch(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stub")
    (root / "torch").mkdir()
    (root / "torch" / "__init__.py").write_text('raise RuntimeError("PyTorch was imported")\n')
    return root


def mlx_fun(stub: Path, *args, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stub), str(ROOT)]), "MLX_FUN_NO_FAST_BLAS": "1",
               **(env or {})}
    proc = subprocess.run([sys.executable, "-c", PROBE, *map(str, args)], capture_output=True, text=True,
                          env=environ, timeout=300)
    line = [x for x in proc.stderr.splitlines() if x.startswith("MODULES=")]
    assert line, proc.stderr
    return proc, json.loads(line[-1].split("=", 1)[1])


@pytest.fixture(scope="module")
def saliency(tmp_path_factory, qwen_model) -> Path:
    out = tmp_path_factory.mktemp("sal") / "s.npz"
    jobs.collect.run(model=qwen_model, dataset=DATA, output=out, max_samples=4, max_tokens=32)
    return out


def test_the_stub_would_catch_an_import_of_torch(stub_torch):
    """The probe itself: with PyTorch allowed, importing it through transformers' check fails loudly."""
    proc = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(stub_torch)})
    assert proc.returncode != 0 and "PyTorch was imported" in proc.stderr


def test_commands_that_never_tokenize_import_neither_transformers_nor_torch(stub_torch, qwen_model, saliency,
                                                                            tmp_path):
    other = tmp_path / "other.npz"
    jobs.collect.run(model=qwen_model, dataset=DATA, output=other, max_samples=3, max_tokens=24, seed=1)
    runs = {
        "prune": ["prune", "--model", qwen_model, "--saliency", saliency, "--n-prune", "1", "--output",
                  tmp_path / "pruned"],
        "quantize": ["quantize", "--model", qwen_model, "--output", tmp_path / "q4"],
        "stats-merge": ["stats-merge", "--files", saliency, "--files", other, "--output", tmp_path / "m.npz"],
    }
    for name, args in runs.items():
        proc, modules = mlx_fun(stub_torch, *args)
        assert proc.returncode == 0, (name, proc.stderr[-2000:])
        assert modules == {"torch": False, "transformers": False}, (name, modules)
    assert (tmp_path / "pruned" / "config.json").is_file() and (tmp_path / "q4" / "config.json").is_file()
    assert (tmp_path / "m.npz").is_file()


def test_the_written_models_still_load_with_their_tokenizer(stub_torch, qwen_model, saliency, tmp_path):
    """prune loaded no tokenizer but wrote the source's tokenizer files: mlx-lm loads the result whole."""
    from mlx_lm import load

    proc, _ = mlx_fun(stub_torch, "prune", "--model", qwen_model, "--saliency", saliency, "--n-prune", "1",
                      "--output", tmp_path / "pruned")
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, tokenizer = load(str(tmp_path / "pruned"))
    assert tokenizer.encode("def f(x): return x") == load(str(qwen_model))[1].encode("def f(x): return x")


def test_commands_that_tokenize_load_the_tokenizer_without_torch(stub_torch, qwen_model, tmp_path):
    proc, modules = mlx_fun(stub_torch, "collect", "--model", qwen_model, "--dataset", DATA, "--max-samples", "2",
                            "--max-tokens", "16", "--output", tmp_path / "s.npz")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert modules == {"torch": False, "transformers": True}
    assert "PyTorch was not found" not in proc.stderr  # transformers' advisory line is not shown


def test_eager_imports_bring_torch_back(stub_torch, qwen_model, tmp_path):
    """MLX_FUN_EAGER_IMPORTS=1 (a tokenizer with remote code that needs PyTorch): transformers finds the stub and
    imports it, so the run fails here, which shows the block is what kept PyTorch out above."""
    proc, modules = mlx_fun(stub_torch, "collect", "--model", qwen_model, "--dataset", DATA, "--max-samples", "1",
                            "--max-tokens", "8", "--output", tmp_path / "s.npz", env={"MLX_FUN_EAGER_IMPORTS": "1"})
    assert proc.returncode != 0 and not (tmp_path / "s.npz").exists()


def test_torch_is_hidden_from_transformers_only(stub_torch):
    """transformers settles that PyTorch is absent; afterwards nothing is left in sys.modules for libraries that
    look PyTorch up there (scipy's array-API helpers failed on a None entry), and scipy runs."""
    code = """
import sys
from mlx_fun.runtime import lean_imports
assert lean_imports.block_torch()
from transformers import AutoTokenizer
from transformers.utils import is_torch_available
assert not is_torch_available()
assert "torch" not in sys.modules
from scipy.optimize import linear_sum_assignment
import numpy as np
print(linear_sum_assignment(np.array([[1.0, 2.0], [2.0, 1.0]]))[1].tolist())
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(stub_torch), str(ROOT)])})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[0, 1]"


def test_a_deferred_tokenizer_still_loads_whole_when_something_asks_for_it():
    """A tokenizer-free command that ends up needing the tokenizer gets mlx-lm's real one: the placeholders import
    the real module on first use and mlx-lm's own names are rebound, so its type checks hold."""
    code = f"""
import sys
from pathlib import Path
from mlx_fun.runtime import lean_imports
assert lean_imports.defer_tokenizers()
from mlx_lm.utils import load_model
load_model(Path({str(ROOT / 'data' / 'tiny-moe')!r}), lazy=True)
assert "transformers" not in sys.modules
from mlx_lm import load
import mlx_lm.utils
from mlx_lm.tokenizer_utils import TokenizerWrapper
model, tokenizer = load({str(ROOT / 'data' / 'tiny-moe')!r})
assert isinstance(tokenizer, TokenizerWrapper) and mlx_lm.utils.TokenizerWrapper is TokenizerWrapper
print(tokenizer.encode("def f(x): return x"))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    from mlx_lm import load

    assert proc.stdout.strip() == str(load(str(ROOT / "data" / "tiny-moe"))[1].encode("def f(x): return x"))
