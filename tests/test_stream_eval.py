"""Issue 43: a layer-streamed eval (``eval --stream-layers``): one decoder layer's weights in memory at a time, with
``--reference`` both models side by side; the in-memory eval's numbers (token counts exactly, the means to float
rounding), every family, float and 4-bit; a dense model is refused in one line (the automatic choice evaluates it
in memory)."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from mlx_fun import jobs
from mlx_fun.adapters import get_adapter
from mlx_fun.errors import UserError, cli_names
from mlx_fun.model.io import load_model
from mlx_fun.observe.evaluate import evaluate
from mlx_fun.observe.evaluate_streamed import evaluate_streamed
from mlx_fun.runtime import memory

from .cli_helpers import ROOT, expect_error, interrupting_checkpoint, run
from .conftest import FAMILIES

SAMPLES = {"a": [list(range(5, 21)), list(range(40, 52))], "b": [list(range(60, 76)), [3]]}  # 2 × 16 tokens, ...
SAMPLE = ROOT / "data" / "calibration_sample.jsonl"
ARGS = ["--dataset", SAMPLE, "--max-samples", "4", "--max-tokens", "24", "--batch-size", "2"]
KEYS = ("nll", "ppl", "ref_nll", "ref_ppl", "kl", "top1_agreement")


def _same(streamed: dict, full: dict) -> None:
    assert streamed.keys() == full.keys()
    for name, r in full.items():
        s = streamed[name]
        assert s.keys() == r.keys() and (s["samples"], s["tokens"]) == (r["samples"], r["tokens"]), name
        for key in (k for k in KEYS if k in r):
            assert math.isclose(s[key], r[key], rel_tol=1e-5, abs_tol=1e-6), (name, key, s[key], r[key])


def _lazy(path):
    model, _, config = load_model(path, lazy=True)
    return model, get_adapter(model, config)


@pytest.mark.parametrize("bits", [None, 4], ids=["float", "q4"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_streamed_eval_equals_the_in_memory_eval(make_model, model_type, bits):
    """The model alone, and against a reference (the same family in the other precision: KL > 0, agreement < 1)."""
    kw = {"n_group": 1, "topk_group": 1} if model_type in ("deepseek_v3", "deepseek_v32") else {}
    path, ref_path = make_model(model_type, bits=bits, **kw), make_model(model_type, bits=4 if bits is None else None,
                                                                         **kw)
    model, adapter = _lazy(path)
    if adapter.layerwise_blocker():
        with cli_names(), pytest.raises(UserError, match=f"which {model_type} does not allow: .*without "
                                                         "--stream-layers"):
            evaluate_streamed(model, adapter, SAMPLES, batch_size=2)
        return
    full = evaluate(load_model(path)[0], SAMPLES, reference=load_model(ref_path)[0], batch_size=2)
    assert full["a"]["tokens"] == 26 and full["b"]["tokens"] == 15
    alone = evaluate_streamed(model, adapter, SAMPLES, batch_size=2)
    _same(alone, {name: {k: v for k, v in r.items() if not k.startswith(("ref", "kl", "top1"))}
                  for name, r in full.items()})
    model, adapter = _lazy(path)  # the streamed run released the layers: load again
    reference, ref_adapter = _lazy(ref_path)
    assert full["a"]["kl"] > 0
    _same(evaluate_streamed(model, adapter, SAMPLES, reference, ref_adapter, batch_size=2), full)
    # every layer of both models was released: nothing of their weights is left
    from mlx.utils import tree_flatten

    for a in (adapter, ref_adapter):
        for i, layer in enumerate(a.decoder_layers()):
            assert all(x.size == 0 for _, x in tree_flatten(layer.parameters())), i


# ---------------------------------------------------------------------------------------------- the job
def _json(path) -> dict:
    return {name: {k: v for k, v in r.items() if k != "path"} for name, r in json.loads(path.read_text())["datasets"].items()}


def test_eval_stream_layers_writes_the_in_memory_numbers(tmp_path, make_model):
    model, ref = make_model("gpt_oss", bits=4), make_model("gpt_oss")
    for name, flag in (("mem", "--no-stream-layers"), ("stream", "--stream-layers")):
        result = run("eval", "--model", model, "--reference", ref, *ARGS, "--output", tmp_path / f"{name}.json", flag)
        assert result.exit_code == 0, result.output
    mem, stream = _json(tmp_path / "mem.json"), _json(tmp_path / "stream.json")
    assert mem["calibration_sample"]["tokens"] > 0 and 0 < mem["calibration_sample"]["kl"]
    _same(stream, mem)
    assert not (tmp_path / ".stream.json.stream").exists()  # the checkpoint, removed once the output is written


def _dense(tmp_path, qwen_model):
    """A tiny dense llama directory with the tiny MoE models' tokenizer."""
    from mlx_lm.utils import save_config, save_model

    from mlx_fun.testing.tiny import DEFAULT_VOCAB, build_model

    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
              "num_attention_heads": 4, "rms_norm_eps": 1e-6, "vocab_size": DEFAULT_VOCAB,
              "tie_word_embeddings": False}
    out = tmp_path / "dense"
    out.mkdir()
    save_model(out, build_model(config), donate_model=True)
    save_config(config, config_path=out / "config.json")
    for f in qwen_model.glob("tokenizer*"):
        shutil.copyfile(f, out / f.name)
    for f in qwen_model.glob("special_tokens_map.json"):
        shutil.copyfile(f, out / f.name)
    return out


def test_a_dense_model_is_not_streamed(tmp_path, qwen_model, monkeypatch):
    dense = _dense(tmp_path, qwen_model)
    expect_error(run("eval", "--model", dense, *ARGS, "--stream-layers"),
                 f"--stream-layers runs the decoder layers of a supported Mixture-of-Experts family, and --model "
                 f"{dense} is not one (a dense model?)")
    expect_error(run("eval", "--model", qwen_model, "--reference", dense, *ARGS, "--stream-layers"),
                 f"--reference {dense} is not one")
    lines = []  # the automatic choice: in memory, a note says why
    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)
    alone = jobs.eval.run(model=dense, dataset=[SAMPLE], max_samples=2, log=lines.append)
    assert any("exceed the memory left" in line and "not of a supported Mixture-of-Experts family" in line and "evaluating in memory"
               in line for line in lines), lines
    assert alone.tokens > 0


def test_eval_streams_by_itself_when_the_weights_exceed_the_memory_left(tmp_path, qwen_model, monkeypatch):
    import tempfile

    lines = []
    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)  # too little for a layer: the states spill too
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # without --output: a temporary directory of TMPDIR
    streamed = jobs.eval.run(model=qwen_model, reference=qwen_model, dataset=[SAMPLE], max_samples=2,
                             log=lines.append)
    assert any("exceed the memory left" in line and "streaming the layers" in line and "spilling them" in line
               for line in lines), lines
    assert list(tmp_path.iterdir()) == []
    lines.clear()
    monkeypatch.setattr(memory, "available_bytes", lambda: 1 << 40)
    full = jobs.eval.run(model=qwen_model, reference=qwen_model, dataset=[SAMPLE], max_samples=2, log=lines.append)
    assert not any("streaming" in line for line in lines)
    _same(streamed.results, full.results)
    assert streamed.results["calibration_sample"]["top1_agreement"] == 1.0


def test_a_streamed_eval_interrupted_after_a_layer_resumes_there_with_the_same_numbers(tmp_path, make_model):
    """Both models' drivers of every dataset saved after each layer (``EVERY = 0``); interrupted once layer 1 is
    saved, a second run with the same checkpoint resumes at layer 2 and gives the uninterrupted run's numbers."""
    model, ref = make_model("qwen3_moe", num_hidden_layers=4), make_model("qwen3_moe", num_hidden_layers=4, bits=4)

    def streamed(**kw):
        (m, a), (r, ra) = _lazy(model), _lazy(ref)
        return evaluate_streamed(m, a, SAMPLES, r, ra, batch_size=2, **kw)

    def checkpoint(stop_after=None):
        return interrupting_checkpoint(tmp_path / "ck", "eval", stop_after)

    whole = streamed()
    with pytest.raises(KeyboardInterrupt):
        streamed(checkpoint=checkpoint(stop_after=1))
    said = []
    resumed = streamed(checkpoint=checkpoint(), log=said.append)
    assert said == [f"Resuming at layer 2 of 4 from {tmp_path / 'ck'}."]
    assert resumed == whole and whole["a"]["kl"] > 0
