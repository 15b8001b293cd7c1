"""A command pays only for what it uses (issues 32 and 44, part 1): no command imports PyTorch, even where it is
installed; the commands that never tokenize import neither transformers nor mlx-lm's tokenizer, convert or generate
code, nor huggingface_hub's HTTP stack or scipy.stats; the config check imports no tokenizer code
(:mod:`mlx_fun.runtime.lean_imports`).

Each command runs in a fresh interpreter through the console entry point (``mlx_fun.launcher.main``) with a stub
``torch`` package first on ``sys.path`` that raises on import: a command that imports PyTorch fails. At exit the
process reports which of :data:`HEAVY` it imported (mlx-lm's tokenizer module only when the real one is).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .cli_helpers import python_path

from mlx_fun import jobs

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "calibration_sample.jsonl"

#: what a command that never tokenizes must not import: PyTorch, transformers, mlx-lm's tokenizer code and its
#: modules that import it, huggingface_hub's HTTP stack (mlx_lm.utils takes its snapshot_download by name) and
#: scipy.stats (1-2 s of stats-merge's rank merge)
HEAVY = ("torch", "transformers", "mlx_lm.tokenizer_utils", "mlx_lm.convert", "mlx_lm.generate",
         "huggingface_hub.hf_api", "scipy.stats")
#: Python: which of HEAVY this process has imported (a stand-in of mlx-lm's tokenizer module is not it)
IMPORTED = f"""
def imported():
    return {{name: sys.modules.get(name) is not None and not getattr(sys.modules[name], "_mlx_fun_standin", False)
            for name in {HEAVY!r}}}
"""
PROBE = f"""
import atexit, json, sys
{IMPORTED}
atexit.register(lambda: print("MODULES=" + json.dumps(imported()), file=sys.stderr))
sys.argv = ["mlx-fun"] + sys.argv[1:]
from mlx_fun.launcher import main
main()
"""
NONE = dict.fromkeys(HEAVY, False)


@pytest.fixture(scope="module")
def stub_torch(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stub")
    (root / "torch").mkdir()
    (root / "torch" / "__init__.py").write_text('raise RuntimeError("PyTorch was imported")\n')
    return root


def mlx_fun(stub: Path, *args, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    environ = {**os.environ, "PYTHONPATH": python_path(stub), "MLX_FUN_NO_FAST_BLAS": "1",
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
                          env={**os.environ, "PYTHONPATH": python_path(stub_torch)})
    assert proc.returncode != 0 and "PyTorch was imported" in proc.stderr


def test_commands_that_never_tokenize_import_no_tokenizer_code(stub_torch, qwen_model, make_model, saliency, tmp_path):
    from mlx_fun.cli import TOKENIZER_FREE

    other = tmp_path / "other.npz"
    jobs.collect.run(model=qwen_model, dataset=DATA, output=other, max_samples=3, max_tokens=24, seed=1)
    dsv3 = make_model("deepseek_v3")  # a router bias for amplify to boost
    config = json.loads((dsv3 / "config.json").read_text())
    moe = [i for i in range(config["num_hidden_layers"]) if i >= config["first_k_dense_replace"]]
    domain = tmp_path / "domain.json"
    composite = [[2.0, 2.0] + [0.0] * (config["n_routed_experts"] - 2) for _ in moe]
    domain.write_text(json.dumps({"domain_name": "d", "scores": {"composite": composite},
                                  "domain_experts": {str(moe[0]): [0, 1]}}))
    runs = {
        "prune": ["--model", qwen_model, "--saliency", saliency, "--n-prune", "1", "--output", tmp_path / "pruned"],
        "quantize": ["--model", qwen_model, "--output", tmp_path / "q4"],
        "amplify": ["--model", dsv3, "--domain-map", domain, "--output", tmp_path / "amplified"],
        "tune-dispatch": ["--shape", "64,32,8,2", "--quant", "float32", "--max-m", "1",
                          "--output", tmp_path / "t.json"],
        "stats-diff": ["--file1", saliency, "--file2", other],
        "stats-merge": ["--files", saliency, "--files", other, "--output", tmp_path / "m.npz"],
        "stats-purge": ["--input", other, "--output", tmp_path / "purged.npz", "--min-freq", "1"],
    }
    assert set(runs) == set(TOKENIZER_FREE)
    for name, args in runs.items():
        proc, modules = mlx_fun(stub_torch, name, *args)
        assert proc.returncode == 0, (name, proc.stderr[-2000:])
        assert modules == NONE, (name, modules)
    for written in ("pruned/config.json", "q4/config.json", "amplified/config.json", "t.json", "m.npz", "purged.npz"):
        assert (tmp_path / written).is_file(), written


def test_the_config_check_imports_no_tokenizer_code(qwen_model, tmp_path):
    """read_config as a library call, in a fresh interpreter: mlx-lm's ModelArgs of the model's own file checks the
    config (a missing key is refused) without mlx-lm's package __init__, tokenizer, convert or generate code."""
    broken = tmp_path / "broken"
    broken.mkdir()
    config = json.loads((Path(qwen_model) / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "num_hidden_layers"}))
    code = f"""
import json, sys
{IMPORTED}
from mlx_fun.errors import UserError
from mlx_fun.model.io import read_config
assert read_config({str(qwen_model)!r})["model_type"] == "qwen3_moe"
try:
    read_config({str(broken)!r})
except UserError as e:
    print("REFUSED=" + str(e))
print("MODULES=" + json.dumps(imported()))
print("MODEL_FILE=" + json.dumps("mlx_lm.models.qwen3_moe" in sys.modules))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": python_path()})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    assert json.loads(out["MODULES"]) == NONE and json.loads(out["MODEL_FILE"]) is True
    assert "does not describe a qwen3_moe model mlx-lm can build" in out["REFUSED"]
    assert "num_hidden_layers" in out["REFUSED"]


def test_the_written_models_still_load_with_their_tokenizer(stub_torch, qwen_model, saliency, tmp_path):
    """prune loaded no tokenizer but wrote the source's tokenizer files: mlx-lm loads the result whole."""
    from mlx_lm import load

    proc, _ = mlx_fun(stub_torch, "prune", "--model", qwen_model, "--saliency", saliency, "--n-prune", "1",
                      "--output", tmp_path / "pruned")
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, tokenizer = load(str(tmp_path / "pruned"))
    assert tokenizer.encode("def f(x): return x") == load(str(qwen_model))[1].encode("def f(x): return x")


def test_commands_that_tokenize_need_no_transformers_for_a_tokenizer_json(stub_torch, tmp_path):
    """collect, eval and smoke-test on the bundled chat model load its tokenizer without transformers
    (:mod:`mlx_fun.model.fast_tokenizer`) and write what they write with it (here, in-process): the same saliency,
    perplexity and greedy text."""
    import numpy as np

    model = ROOT / "data" / "tiny-moe-chat"
    sample = ["--dataset", DATA, "--max-samples", "2", "--max-tokens", "16"]
    prompt = "What is the capital of France?"
    runs = {"collect": ["--model", model, *sample, "--seed", "1", "--output", tmp_path / "s.npz"],
            "eval": ["--model", model, *sample, "--output", tmp_path / "e.json"],
            "smoke-test": ["--model", model, "--prompt", prompt, "--max-tokens", "12", "--verbose", "False"]}
    out = {}
    for name, args in runs.items():
        proc, modules = mlx_fun(stub_torch, name, *args)
        assert proc.returncode == 0, (name, proc.stderr[-2000:])
        assert modules["mlx_lm.tokenizer_utils"] and not modules["transformers"] and not modules["torch"], name
        assert not modules["huggingface_hub.hf_api"], name  # a local model downloads nothing
        out[name] = proc.stdout
    jobs.collect.run(model=model, dataset=DATA, output=tmp_path / "t.npz", max_samples=2, max_tokens=16, seed=1)
    lean, usual = np.load(tmp_path / "s.npz"), np.load(tmp_path / "t.npz")
    assert lean.files == usual.files and all(np.array_equal(lean[k], usual[k]) for k in lean.files)
    ppl = jobs.eval.run(model=model, dataset=[DATA], max_samples=2, max_tokens=16)
    assert json.loads((tmp_path / "e.json").read_text())["datasets"] == json.loads(json.dumps(ppl.report["datasets"]))
    text = jobs.smoke_test.run(model=model, prompt=prompt, max_tokens=12).generation.text
    assert out["smoke-test"].strip() == text.strip() and text.strip()


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
                          env={**os.environ, "PYTHONPATH": python_path(stub_torch)})
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
assert "transformers" not in sys.modules and "huggingface_hub.hf_api" not in sys.modules
from mlx_lm import load
import huggingface_hub
import mlx_lm.utils
from mlx_lm.tokenizer_utils import TokenizerWrapper
model, tokenizer = load({str(ROOT / 'data' / 'tiny-moe')!r})
assert isinstance(tokenizer, TokenizerWrapper) and mlx_lm.utils.TokenizerWrapper is TokenizerWrapper
assert mlx_lm.utils.snapshot_download is huggingface_hub.snapshot_download  # the real one, rebound
print(tokenizer.encode("def f(x): return x"))
"""
    env = {**os.environ, "PYTHONPATH": python_path()}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    from mlx_lm import load

    assert proc.stdout.strip() == str(load(str(ROOT / "data" / "tiny-moe"))[1].encode("def f(x): return x"))


@pytest.mark.parametrize("given, shown", [(None, "full float32 (MLX_ENABLE_TF32=0)"),
                                          ("1", "TF32 allowed where the hardware has it (MLX_ENABLE_TF32=1)")])
def test_the_console_keeps_float32_matmuls_in_float32_unless_told(given, shown):
    """MLX runs float32 matmuls as TF32 on CUDA and Apple M5 unless MLX_ENABLE_TF32=0, read once: the console sets it
    before mlx is imported (REAP then matches its float32 reference on a GPU, docs/benchmarks/parity.md), and a
    value the user gave stays. `doctor` says which is in effect."""
    from mlx_fun.core import env

    environ = {k: v for k, v in os.environ.items() if k != env.TF32} | {"PYTHONPATH": python_path()}
    if given is not None:
        environ[env.TF32] = given
    out = subprocess.run([sys.executable, "-m", "mlx_fun", "doctor"], env=environ, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"float32 matmuls: {shown}" in out.stdout.splitlines(), out.stdout
    mine = {}
    assert env.keep_float32(mine) == "0" and mine == {env.TF32: "0"}
    mine = {env.TF32: ""}
    assert env.keep_float32(mine) == "" and mine == {env.TF32: ""}  # set, even blank: the user's choice
