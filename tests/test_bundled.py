"""The bundled trained MoE under data/, `mlx-fun demo` on it, and the training script."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from mlx_fun.cli import main
from mlx_fun.model.io import bundled_model_dir
from mlx_fun.output.model_dir import dir_size

from .cli_helpers import script

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "data" / "tiny-moe"


def test_bundled_model_is_a_small_plain_mlx_lm_model():
    import mlx.core as mx
    from mlx_lm import load

    assert bundled_model_dir() == BUNDLED
    assert dir_size(BUNDLED) <= 25_000_000
    model, tokenizer = load(str(BUNDLED))
    config = json.loads((BUNDLED / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_experts"] >= 16
    log = json.loads((BUNDLED / "training_log.json").read_text())
    assert log["final_val_ppl"]["code"] <= 10 and log["final_val_ppl"]["prose"] <= 20
    # routed like a real MoE trained with a balance loss: every expert used, none collapsed onto (issue 33)
    assert all(1.5 <= r <= 30 for r in log["routing_max_min_ratio"])
    assert "Held-out perplexity" in (BUNDLED / "README.md").read_text()
    # it is trained: it prefers real Python over shuffled tokens of the same text
    ids = tokenizer.encode("def main():\n    for line in open(path):\n        print(line)\n")
    shuffled = [int(i) for i in np.random.default_rng(0).permutation(ids)]

    def nll(seq):
        logits = model(mx.array([seq[:-1]])).astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return -mx.take_along_axis(lp[0], mx.array(seq[1:])[:, None], axis=-1).mean().item()

    assert nll(ids) < nll(shuffled) - 1.0


def test_demo_runs_end_to_end_on_the_bundled_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "mlx-fun-demo"  # its default --output: everything it writes lies in that one directory
    result = CliRunner().invoke(main, ["demo", "--max-samples", "6", "--max-tokens", "64"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert [p.name for p in tmp_path.iterdir()] == ["mlx-fun-demo"]
    assert sorted(p.name for p in out.iterdir()) == [".mlx-fun-demo", "corpus", "eval.json", "pruned", "saliency.npz",
                                                      "summary.md"]
    for step in ("$ mlx-fun collect", "$ mlx-fun prune", "$ mlx-fun smoke-test", "$ mlx-fun eval", "== summary"):
        assert step in result.output
    assert result.output.splitlines()[0].startswith("blas: ")  # says which BLAS it runs on
    if "preloaded" not in result.output.splitlines()[0]:  # this in-process run is not re-exec'ed: the slow BLAS
        assert "this demo takes about 5x longer (115 s instead of 25 s" in result.output
    report = json.loads((out / "eval.json").read_text())
    assert set(report["datasets"]) == {"code", "prose"}
    for d in report["datasets"].values():
        assert d["kl"] > 0 and 0 < d["top1_agreement"] < 1 and d["ppl"] > 1 and d["ref_ppl"] > 1
    pruned = json.loads((out / "pruned" / "config.json").read_text())
    assert pruned["num_experts"] == 36
    assert "| original" not in (out / "summary.md").read_text() and "pruned" in (out / "summary.md").read_text()
    # a re-run reuses the prepared corpus and replaces its own outputs
    manifest = (out / "corpus" / "manifest.json").stat().st_mtime_ns
    again = CliRunner().invoke(main, ["demo", "--output", str(out), "--max-samples", "4", "--max-tokens", "32",
                                      "--prune-fraction", "0.5", "--metric", "freq"], catch_exceptions=False)
    assert again.exit_code == 0, again.output
    assert (out / "corpus" / "manifest.json").stat().st_mtime_ns == manifest
    assert json.loads((out / "pruned" / "config.json").read_text())["num_experts"] == 24


def test_demo_refuses_a_directory_it_did_not_create(tmp_path):
    (tmp_path / "mine.txt").write_text("precious")
    result = CliRunner().invoke(main, ["demo", "--output", str(tmp_path)])
    assert result.exit_code == 2 and "did not create" in result.output
    assert (tmp_path / "mine.txt").read_text() == "precious" and len(list(tmp_path.iterdir())) == 1


def test_train_script_runs_a_few_steps_and_saves_a_loadable_model(tmp_path):
    from mlx_fun.datasets import corpus

    data = tmp_path / "corpus"
    corpus.prepare(data, max_samples=12, max_eval_samples=2, max_chars=512)
    out = tmp_path / "model"
    r = script(
        "training.train_tiny_moe", "--data", data, "--output", out,
        "--vocab-size", "300", "--hidden", "32", "--layers", "1", "--experts", "4", "--top-k", "2",
        "--moe-intermediate", "16", "--heads", "2", "--kv-heads", "1", "--seq-len", "32", "--batch-size", "2",
        "--steps", "4", "--warmup", "2", "--eval-every", "2", "--eval-windows", "2", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "validation:" in r.stdout and "tok/s" in r.stdout
    if sys.platform.startswith("linux"):  # the script re-execs with the fast BLAS, as the mlx-fun launcher does
        assert "blas: OpenBLAS preloaded" in r.stdout.splitlines()[0], r.stdout
    log = json.loads((out / "training_log.json").read_text())
    assert log["steps"] == 4 and len(log["evals"]) == 2 and set(log["final_val_ppl"]) == {"code", "prose"}
    from mlx_lm import load

    model, _ = load(str(out))
    assert model.args.num_experts == 4
