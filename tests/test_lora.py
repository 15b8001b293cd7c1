"""Issue 44 part 2: ``--adapter-path`` (a LoRA adapter as mlx_lm.lora writes it, mlx-lm's ``load(adapter_path=...)``)
on every command that loads a model for a forward. The adapter is fused into the weights as they load (mlx_lm.fuse's
arithmetic): the model computes what mlx-lm's unfused adapter computes, the statistics are the fine-tune's, a
rewrite writes the fused weights (never the base's copied from its files) and says so in its metadata and card, and
a bad adapter is one line, exit 2. One tiny model and one adapter (mlx-lm's own ``linear_to_lora_layers``) for all."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from mlx_fun import jobs
from mlx_fun.model import lora
from mlx_fun.model.io import load_model
from mlx_fun.testing.tiny import make_tiny_adapter

from .cli_helpers import expect_error, run
from .test_cli import SAMPLE

PROMPT = "The quick brown fox jumps over the lazy dog. Mixture of experts"


@pytest.fixture(scope="module")
def tuned(make_model, tmp_path_factory):
    """``(model dir, adapter dir)``: a tiny qwen3_moe and a LoRA adapter of all its layers (router and experts
    included), saved as mlx_lm.lora saves one."""
    model = make_model("qwen3_moe")
    return model, make_tiny_adapter(model, tmp_path_factory.mktemp("adapter") / "adapters", seed=1)


@pytest.fixture(scope="module")
def collected(tuned, tmp_path_factory):
    """The statistics files of one calibration set on the model without and with the adapter (and streamed with
    it), by name."""
    model, adapter = tuned
    out = tmp_path_factory.mktemp("collected")
    kw = dict(model=model, dataset=SAMPLE, max_samples=6, max_tokens=48, seed=0)
    runs = {"base": jobs.collect.run(output=out / "base.npz", **kw),
            "tuned": jobs.collect.run(output=out / "tuned.npz", adapter_path=adapter, **kw),
            "streamed": jobs.collect.run(output=out / "streamed.npz", adapter_path=adapter, stream_layers=True, **kw)}
    return {name: result.output for name, result in runs.items()}


def test_the_fused_model_computes_what_mlx_lm_s_adapter_computes(tuned):
    from mlx_lm import load

    model, adapter = tuned
    theirs, tokenizer = load(str(model), adapter_path=str(adapter))  # mlx-lm: LoRA layers, unfused
    ours, _, _ = load_model(model, adapter_path=adapter)
    base, _, _ = load_model(model)
    tokens = mx.array([tokenizer.encode(PROMPT)])
    want = np.array(theirs(tokens))
    np.testing.assert_allclose(np.array(ours(tokens)), want, atol=2e-5)
    assert np.abs(np.array(base(tokens)) - want).max() > 0.1  # the adapter matters
    assert not [name for name, _ in ours.named_modules() if "LoRA" in type(_).__name__]
    changed = lora.adapted(ours)
    assert "model.layers.0.mlp.gate.weight" in changed and "model.layers.1.mlp.switch_mlp.down_proj.weight" in changed
    assert "model.embed_tokens.weight" not in changed and lora.adapted(base) == frozenset()


def test_an_adapter_changes_what_collect_measures_and_is_recorded(tuned, collected):
    """Same samples, same tokens: the adapter moves the routing; streamed with the adapter is in-memory with it."""
    base, tuned_, streamed = (np.load(collected[name]) for name in ("base", "tuned", "streamed"))
    assert int(base["total_tokens"]) == int(tuned_["total_tokens"]) > 0
    assert base["freq"].sum() == tuned_["freq"].sum() and not np.array_equal(base["freq"], tuned_["freq"])
    np.testing.assert_array_equal(streamed["freq"], tuned_["freq"])
    np.testing.assert_allclose(streamed["reap_sum"], tuned_["reap_sum"], rtol=1e-4)
    record = json.loads(str(tuned_["adapter"]))
    assert record["path"] == str(tuned[1]) and record["rank"] == 4 and record["fused"] is True
    assert "adapter" not in base
    from mlx_fun.observe.saliency import SaliencyAccumulator

    assert SaliencyAccumulator.load(collected["tuned"]).adapter == record


def test_a_bad_adapter_is_one_line(tuned, tmp_path, make_model):
    model, adapter = tuned
    args = ("collect", "--model", model, "--dataset", SAMPLE, "--output", tmp_path / "s.npz", "--max-samples", 2)
    expect_error(run(*args, "--adapter-path", tmp_path / "nope"), "--adapter-path", "does not exist",
                 "mlx_lm.lora")
    (tmp_path / "empty").mkdir()
    expect_error(run(*args, "--adapter-path", tmp_path / "empty"), "--adapter-path", "has no adapter_config.json")
    bad = tmp_path / "bad"
    shutil.copytree(adapter, bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    config["lora_parameters"] = {"rank": 4, "alpha": 16, "dropout": 0.0}  # another framework's name for the scale
    (bad / "adapter_config.json").write_text(json.dumps(config))
    expect_error(run(*args, "--adapter-path", bad), "--adapter-path", "scale")
    other = make_model("qwen3_moe", hidden_size=48)  # another model's shapes
    expect_error(run("collect", "--model", other, "--dataset", SAMPLE, "--output", tmp_path / "s.npz",
                     "--adapter-path", adapter), "--adapter-path", "does not fit --model", "incompatible")
    assert not (tmp_path / "s.npz").exists()
    expect_error(run("smoke-test", "--model", model, "--adapter-path", tmp_path / "empty"), "--adapter-path")


def test_prune_writes_the_fused_weights_and_names_the_adapter(tuned, collected, tmp_path):
    """The rewrite fuses (mlx_lm.fuse's arithmetic): a tensor the prune leaves alone is the fused one, not the
    base's bytes copied from its files, and the kept experts are the fused experts' rows."""
    model, adapter = tuned
    res = run("prune", "--model", model, "--adapter-path", adapter, "--saliency", collected["tuned"],
              "--n-prune", 2, "--output", tmp_path / "pruned")
    assert res.exit_code == 0, res.output
    fused, _, _ = load_model(model, adapter_path=adapter)
    written = mx.load(str(tmp_path / "pruned" / "model.safetensors"))
    source = mx.load(str(model / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_allclose(np.array(written[name]), np.array(fused.model.layers[0].self_attn.q_proj.weight),
                               atol=1e-6)
    assert not np.allclose(np.array(written[name]), np.array(source[name]), atol=1e-3)
    meta = json.loads((tmp_path / "pruned" / "reap_metadata.json").read_text())
    keep = meta["keep_map"]["0"]
    experts = fused.model.layers[0].mlp.switch_mlp.gate_proj.weight[mx.array(keep)]
    np.testing.assert_allclose(np.array(written["model.layers.0.mlp.switch_mlp.gate_proj.weight"]), np.array(experts),
                               atol=1e-6)
    assert meta["adapter"]["path"] == str(adapter) and meta["adapter"]["sha256"]
    card = (tmp_path / "pruned" / "README.md").read_text()
    assert f"with the lora adapter `{adapter.name}` fused into it" in card and str(adapter.parent) not in card


def test_merge_fuses_the_adapter_into_what_it_writes(tuned, tmp_path):
    model, adapter = tuned
    res = run("merge", "--model", model, "--adapter-path", adapter, "--n-prune", 2, "--dataset", SAMPLE, "--max-samples", 4, "--max-tokens", 32, "--max-similarity-tokens",
              16, "--max-alignment-tokens", 16, "--seed", 0, "--output", tmp_path / "merged")
    assert res.exit_code == 0, res.output
    fused, _, _ = load_model(model, adapter_path=adapter)
    written = mx.load(str(tmp_path / "merged" / "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj.weight"  # merging leaves attention alone: the fused weights stay
    np.testing.assert_allclose(np.array(written[name]), np.array(fused.model.layers[1].self_attn.o_proj.weight),
                               atol=1e-6)
    meta = json.loads((tmp_path / "merged" / "ream_metadata.json").read_text())
    assert meta["adapter"]["path"] == str(adapter)
    assert "adapter fused first" in (tmp_path / "merged" / "README.md").read_text()


def test_eval_scores_the_fine_tune_against_the_base(tuned, tmp_path):
    model, adapter = tuned
    got = jobs.eval.run(model=model, adapter_path=adapter, reference=model, dataset=[SAMPLE], max_samples=2,
                        max_tokens=32, output=tmp_path / "eval.json")
    (scores,) = got.results.values()
    assert scores["kl"] > 1e-3 and scores["ppl"] != scores["ref_ppl"]
    assert json.loads((tmp_path / "eval.json").read_text())["adapter"]["path"] == str(adapter)


def test_a_quantized_base_is_fused_as_mlx_lm_fuse_writes_it_and_says_so(make_model, tmp_path):
    """Quantized layers are re-quantized after fusing, as mlx_lm.fuse writes them (the weights stay 4-bit); the log
    says the model is the fused one, not mlx-lm's unfused adapter on the quantized base."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    model = make_model("qwen3_moe", bits=4)
    adapter = make_tiny_adapter(model, tmp_path / "adapters", seed=3)
    fused, _, _ = load_model(model, adapter_path=adapter)
    assert isinstance(fused.model.layers[0].mlp.switch_mlp.gate_proj, QuantizedSwitchLinear)
    assert lora.note(fused) and lora.note(load_model(model)[0]) is None
    res = run("smoke-test", "--model", model, "--adapter-path", adapter, "-m", 4)
    assert res.exit_code == 0 and "re-quantized with their own bits as mlx_lm.fuse writes them" in res.stderr


def test_a_streamed_abliterate_with_an_adapter_is_refused_in_one_line(tuned, tmp_path):
    """abliterate --stream-layers reads its layers again from the model's files, where the adapter fused as the
    model loaded would be lost: one line, fuse it first; nothing written."""
    from pathlib import Path

    model, adapter = tuned
    safety = Path(__file__).resolve().parents[1] / "data" / "safety"
    out = tmp_path / "abl"
    expect_error(run("abliterate", "--model", model, "--harmful-dataset", safety / "harmful_train.jsonl",
                     "--benign-dataset", safety / "benign_train.jsonl", "--output", out, "--adapter-path", adapter,
                     "--stream-layers"),
                 "--adapter-path", "--stream-layers reads each layer from the model's files", "mlx_lm fuse")
    assert not out.exists()
