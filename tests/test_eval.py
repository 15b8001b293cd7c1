"""`mlx-fun eval` and mlx_fun.observe.evaluate: perplexity, KL(reference ‖ model), top-1 agreement."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_fun.errors import UserError
from mlx_fun.observe.evaluate import (
    ReferenceCache,
    check_compatible,
    evaluate,
    format_results,
    load_eval_datasets,
    resolve_datasets,
)
from mlx_fun.model.io import load_model
from .cli_helpers import expect_error as _error, run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "data" / "calibration_sample.jsonl"






@pytest.fixture(scope="module")
def float_model(make_model):
    return make_model("qwen3_moe")


@pytest.fixture(scope="module")
def quant_model(make_model):
    return make_model("qwen3_moe", bits=4)


@pytest.fixture(scope="module")
def loaded(float_model):
    model, tokenizer, _ = load_model(float_model)
    return model, tokenizer


@pytest.fixture(scope="module")
def data(loaded):
    _, tokenizer = loaded
    return load_eval_datasets([SAMPLE], tokenizer, max_samples=12, max_tokens=40, seed=1)


def _log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


# --------------------------------------------------------------------------------------------- library


def test_self_comparison_gives_zero_kl_and_full_agreement(float_model, loaded, data):
    model, _ = loaded
    other, _, _ = load_model(float_model)  # a separate instance: two real forwards per batch
    for ref in (other, model):
        r = evaluate(model, data, reference=ref, batch_size=3)["calibration_sample"]
        assert abs(r["kl"]) < 1e-6 and r["top1_agreement"] == 1.0
        assert r["ref_nll"] == pytest.approx(r["nll"], abs=1e-9) and r["ref_ppl"] == pytest.approx(r["ppl"])
    assert set(r) == {"samples", "tokens", "nll", "ppl", "ref_nll", "ref_ppl", "kl", "top1_agreement"}


def test_perplexity_matches_plain_forward_and_numpy(loaded, data):
    """Expected NLL from a plain (unbatched) forward per sample and a float64 numpy log-softmax."""
    model, _ = loaded
    samples = data["calibration_sample"]
    total, n = 0.0, 0
    for s in samples:
        logits = np.array(model(mx.array([s]))[0].astype(mx.float32))
        lp = _log_softmax64(logits[:-1])
        total -= lp[np.arange(len(s) - 1), np.array(s[1:])].sum()
        n += len(s) - 1
    r = evaluate(model, data, batch_size=5)["calibration_sample"]
    assert r["tokens"] == n == sum(len(s) - 1 for s in samples) and r["samples"] == len(samples)
    assert r["nll"] == pytest.approx(total / n, rel=1e-5)
    assert r["ppl"] == pytest.approx(math.exp(total / n), rel=1e-4)
    assert "kl" not in r


class _Bigram:
    """A constructed model: the logits at position t are table[token_t] (known log-probabilities)."""

    def __init__(self, table):
        self.table = mx.array(np.asarray(table, dtype=np.float32))

    def __call__(self, inputs):
        return self.table[inputs]


def test_hand_checked_constructed_model():
    p = np.array([[0.5, 0.25, 0.125, 0.125], [0.1, 0.2, 0.3, 0.4], [0.25] * 4, [0.7, 0.1, 0.1, 0.1]])
    q = np.array([[0.25] * 4, [0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7]])
    model, ref = _Bigram(np.log(p) + 3.0), _Bigram(np.log(q))  # shifting logits changes nothing
    samples = {"tiny": [[0, 1, 2, 1], [3], [2, 0]]}  # the 1-token sample scores nothing
    # predictions: 0→1, 1→2, 2→1, 2→0
    nll = -(math.log(0.25) + math.log(0.3) + math.log(0.25) + math.log(0.25)) / 4
    ref_nll = -(math.log(0.25) + math.log(0.3) + math.log(0.3) + math.log(0.4)) / 4

    def kl(a, b):
        return float(np.sum(q[a] * np.log(q[a] / p[b])))

    expected_kl = (kl(0, 0) + kl(1, 1) + kl(2, 2) + kl(2, 2)) / 4
    # argmax p / q per context token 0, 1, 2, 2: (0 vs 0) (3 vs 3) (0 vs 0) (0 vs 0); argmax of a tie → lowest id
    for bs in (1, 2, 3):
        r = evaluate(model, samples, reference=ref, batch_size=bs)["tiny"]
        assert r["samples"] == 2 and r["tokens"] == 4
        assert r["nll"] == pytest.approx(nll, rel=1e-6)
        assert r["ppl"] == pytest.approx((0.25 * 0.3 * 0.25 * 0.25) ** -0.25, rel=1e-6)
        assert r["ref_nll"] == pytest.approx(ref_nll, rel=1e-6)
        assert r["kl"] == pytest.approx(expected_kl, rel=1e-5)
        assert r["top1_agreement"] == 1.0
    # uniform logits: perplexity is exactly the vocabulary size
    uniform = _Bigram(np.zeros((4, 7)))
    r = evaluate(uniform, {"u": [[0, 1, 2, 3, 3, 2]]})["u"]
    assert r["ppl"] == pytest.approx(7.0, rel=1e-6)
    # a reference that disagrees everywhere: agreement 0
    r = evaluate(_Bigram(np.eye(4)), {"d": [[0, 1, 2, 3]]}, reference=_Bigram(np.roll(np.eye(4), 1, axis=1)))["d"]
    assert r["top1_agreement"] == 0.0 and r["kl"] > 0


def test_padding_and_batch_size_do_not_change_results(loaded, quant_model, tokenizer_dir):
    model, tokenizer = loaded
    qmodel, _, _ = load_model(quant_model)
    data = load_eval_datasets([SAMPLE], tokenizer, max_samples=16, max_tokens=64, seed=0)
    lengths = {len(s) for s in data["calibration_sample"]}
    assert len(lengths) > 3  # different lengths: batches are padded
    results = [evaluate(qmodel, data, reference=model, batch_size=bs)["calibration_sample"] for bs in (1, 3, 16)]
    for r in results[1:]:
        assert r["tokens"] == results[0]["tokens"]
        for key in ("nll", "ref_nll", "kl", "top1_agreement"):
            assert r[key] == pytest.approx(results[0][key], rel=1e-5, abs=1e-7), key
    # pad id does not matter either
    r = evaluate(qmodel, data, reference=model, batch_size=16, pad_id=7)["calibration_sample"]
    assert r["nll"] == pytest.approx(results[0]["nll"], rel=1e-5)


def test_quantized_model_against_float(loaded, quant_model, data):
    model, _ = loaded
    qmodel, qtok, _ = load_model(quant_model)
    r = evaluate(qmodel, data, reference=model)["calibration_sample"]
    assert math.isfinite(r["ppl"]) and r["ppl"] > 1
    assert r["kl"] > 1e-6 and 0 < r["top1_agreement"] <= 1
    assert r["ppl"] != r["ref_ppl"]
    q2, _, _ = load_model(quant_model)
    same = evaluate(qmodel, data, reference=q2)["calibration_sample"]
    assert abs(same["kl"]) < 1e-6 and same["top1_agreement"] == 1.0
    assert same["nll"] == pytest.approx(r["nll"], rel=1e-6)


def test_reference_cache_equals_live_reference(loaded, quant_model, data):
    model, _ = loaded
    qmodel, _, _ = load_model(quant_model)
    cache = ReferenceCache.build(model, data, batch_size=4)
    assert cache.nbytes == data_tokens(data) * cache.vocab * 4
    live = evaluate(qmodel, data, reference=model, batch_size=4)
    cached = evaluate(qmodel, data, reference=cache, batch_size=4)
    for key, value in live["calibration_sample"].items():
        assert cached["calibration_sample"][key] == pytest.approx(value, rel=1e-6), key
    with pytest.raises(ValueError, match="batch_size"):
        evaluate(qmodel, data, reference=cache, batch_size=2)
    with pytest.raises(ValueError, match="differ"):
        evaluate(qmodel, {"calibration_sample": data["calibration_sample"][:-1]}, reference=cache, batch_size=4)
    with pytest.raises(ValueError, match="max_bytes"):
        ReferenceCache.build(model, data, batch_size=4, max_bytes=1000)


def data_tokens(data):
    return sum(len(s) - 1 for samples in data.values() for s in samples if len(s) >= 2)


@pytest.mark.parametrize("family,bits,mode", [("mixtral", None, "affine"), ("gpt_oss", None, "mxfp4"),
                                              ("deepseek_v3", 4, "affine")])
def test_other_families(make_model, family, bits, mode):
    path = make_model(family, bits=bits, mode=mode)
    m1, tok, _ = load_model(path)
    m2, _, _ = load_model(path)
    data = load_eval_datasets([SAMPLE], tok, max_samples=6, max_tokens=32)
    a = evaluate(m1, data, reference=m2, batch_size=1)["calibration_sample"]
    b = evaluate(m1, data, reference=m2, batch_size=6)["calibration_sample"]
    assert math.isfinite(a["ppl"]) and abs(a["kl"]) < 1e-6 and a["top1_agreement"] == 1.0
    assert b["nll"] == pytest.approx(a["nll"], rel=1e-5)


def test_resolve_datasets_names(tmp_path):
    (tmp_path / "code").mkdir()
    (tmp_path / "prose").mkdir()
    (tmp_path / "docs").mkdir()
    for p in ("code/test.jsonl", "prose/test.jsonl", "other.jsonl"):
        (tmp_path / p).write_text('{"content": "hello world"}\n')
    names = resolve_datasets([tmp_path / "code/test.jsonl", tmp_path / "prose/test.jsonl", tmp_path / "other.jsonl",
                              tmp_path / "docs", f"mine={SAMPLE}"])
    assert list(names) == ["code/test", "prose/test", "other", "docs", "mine"]
    assert names["mine"] == SAMPLE
    with pytest.raises(UserError, match="does not exist"):
        resolve_datasets([tmp_path / "missing.jsonl"])
    with pytest.raises(UserError, match="twice"):
        resolve_datasets([SAMPLE, SAMPLE])
    with pytest.raises(UserError, match="both named"):
        resolve_datasets([f"a={SAMPLE}", f"a={tmp_path / 'other.jsonl'}"])


def test_too_short_dataset_and_format(tmp_path, loaded):
    _, tokenizer = loaded
    short = tmp_path / "short.jsonl"
    short.write_text('{"content": "a"}\n')
    with pytest.raises(UserError, match="at least 2 tokens"):
        load_eval_datasets([short], tokenizer)
    table = format_results({"x": {"samples": 2, "tokens": 10, "nll": 1.0, "ppl": math.e, "ref_nll": 1.0,
                                  "ref_ppl": math.e, "kl": 0.0, "top1_agreement": 1.0}})
    assert "ref ppl" in table and "2.72" in table and "100.0%" in table


def test_check_compatible(loaded):
    _, tok = loaded
    check_compatible(tok, tok, {"vocab_size": 512}, {"text_config": {"vocab_size": 512}})
    with pytest.raises(UserError, match="512 tokens but --reference has 640"):
        check_compatible(None, None, {"vocab_size": 512}, {"text_config": {"vocab_size": 640}})


# --------------------------------------------------------------------------------------------- CLI


def test_eval_help():
    result = run("eval", "--help")
    assert result.exit_code == 0
    for flag in ("--model", "--reference", "--dataset", "--max-samples", "--max-tokens", "--seed", "--batch-size",
                 "--output"):
        assert flag in result.output
    assert "Example" in result.output
    lines = [ln for ln in run("--help").output.splitlines() if ln.strip().startswith("eval ")]
    assert len(lines) == 1


def test_eval_cli_end_to_end(tmp_path, float_model, quant_model):
    docs = tmp_path / "prose"
    docs.mkdir()
    (docs / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 8)
    (docs / "b.txt").write_text("Mixture of experts models route each token to a few experts. " * 6)
    out = tmp_path / "res" / "eval.json"
    result = run("eval", "--model", quant_model, "--reference", float_model, "--dataset", SAMPLE, "--dataset", docs,
                 "--max-samples", 8, "--max-tokens", 48, "--batch-size", 3, "--output", out)
    assert result.exit_code == 0, result.output
    header = [ln for ln in result.output.splitlines() if ln.startswith("dataset")]
    assert len(header) == 1 and all(c in header[0] for c in ("tokens", "ppl", "ref ppl", "KL", "top-1"))
    assert any(ln.startswith("calibration_sample ") for ln in result.output.splitlines())
    assert any(ln.startswith("prose ") for ln in result.output.splitlines())
    report = json.loads(out.read_text())
    assert report["model"] == str(quant_model) and report["reference"] == str(float_model)
    assert report["settings"] == {"max_samples": 8, "max_tokens": 48, "seed": 0, "text_key": "content",
                                  "batch_size": 3, "pad_id": report["settings"]["pad_id"], "dispatch": "auto",
                                  "token_budget": 8192}
    # mlx-lm's own SwitchGLU scores the same numbers (float tolerance: the dispatch may block rows differently)
    out2 = tmp_path / "res" / "eval_mlx_lm.json"
    again = run("eval", "--model", quant_model, "--reference", float_model, "--dataset", SAMPLE, "--dataset", docs,
                "--max-samples", 8, "--max-tokens", 48, "--batch-size", 3, "--output", out2, "--dispatch", "mlx-lm")
    assert again.exit_code == 0, again.output
    plain = json.loads(out2.read_text())
    assert plain["settings"]["dispatch"] == "mlx-lm"
    for name, d in report["datasets"].items():
        assert d["ppl"] == pytest.approx(plain["datasets"][name]["ppl"], rel=1e-4)
        assert d["kl"] == pytest.approx(plain["datasets"][name]["kl"], rel=1e-3, abs=1e-5)
    assert set(report["versions"]) >= {"mlx_fun", "mlx", "mlx_lm"}
    assert list(report["datasets"]) == ["calibration_sample", "prose"]
    for r in report["datasets"].values():
        assert set(r) == {"path", "samples", "tokens", "nll", "ppl", "ref_nll", "ref_ppl", "kl", "top1_agreement"}
        assert r["tokens"] > 0 and r["kl"] > 0 and 0 < r["top1_agreement"] <= 1
    assert report["datasets"]["prose"]["samples"] == 2
    assert not list(out.parent.glob(".eval.json*"))

    # model against itself (loaded twice), no --output
    result = run("eval", "--model", float_model, "--reference", float_model, "--dataset", SAMPLE,
                 "--max-samples", 4, "--max-tokens", 32)
    assert result.exit_code == 0, result.output
    row = [ln for ln in result.output.splitlines() if ln.startswith("calibration_sample")][0].split()
    assert row[-2:] == ["0.0000", "100.0%"]

    # without a reference: only perplexity
    result = run("eval", "--model", float_model, "--dataset", SAMPLE, "--max-samples", 4, "--max-tokens", 32)
    assert result.exit_code == 0 and "ref ppl" not in result.output and "ppl" in result.output


def test_eval_cli_errors(tmp_path, float_model, make_model):
    missing = tmp_path / "nope"
    _error(run("eval", "--model", missing, "--dataset", SAMPLE), "--model", "does not exist")
    _error(run("eval", "--model", float_model, "--reference", missing, "--dataset", SAMPLE),
           "--reference", "does not exist")
    _error(run("eval", "--model", float_model, "--dataset", tmp_path / "missing.jsonl"), "does not exist")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": "fine text"}\n{"content": "broken"\n')
    _error(run("eval", "--model", float_model, "--dataset", bad), "bad.jsonl", "line 2")
    _error(run("eval", "--model", float_model, "--dataset", SAMPLE, "--output", tmp_path), "is a directory")

    # reference with another vocabulary size (config)
    other = make_model("qwen3_moe", vocab_size=640)
    _error(run("eval", "--model", float_model, "--reference", other, "--dataset", SAMPLE), "vocabulary", "640")

    # same size, different token → id map (tokenizer)
    swapped = tmp_path / "swapped"
    shutil.copytree(float_model, swapped)
    tj = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = list(vocab)[100], list(vocab)[101]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tj))
    _error(run("eval", "--model", float_model, "--reference", swapped, "--dataset", SAMPLE), "tokenizers",
           "different ids")
    assert not list(tmp_path.glob("*.json"))


def test_chunked_log_softmax_gives_the_same_numbers(loaded, quant_model, data, monkeypatch):
    """Positions are reduced in chunks of CHUNK_ELEMENTS logits; many small chunks change nothing."""
    import mlx_fun.observe.evaluate as ev

    model, _ = loaded
    qmodel, _, _ = load_model(quant_model)
    whole = evaluate(qmodel, data, reference=model, batch_size=4)["calibration_sample"]
    monkeypatch.setattr(ev, "CHUNK_ELEMENTS", 512 * 7)  # 7 positions per chunk
    chunked = evaluate(qmodel, data, reference=model, batch_size=4)["calibration_sample"]
    cached = evaluate(qmodel, data, reference=ReferenceCache.build(model, data, batch_size=4), batch_size=4)
    for key, value in whole.items():
        assert chunked[key] == pytest.approx(value, rel=1e-6), key
        assert cached["calibration_sample"][key] == pytest.approx(value, rel=1e-6), key
