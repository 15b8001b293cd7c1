"""safety-scan / domain-scan: the differential tap counts what collect counts (every family), a synthetic domain is
found, reports feed prune and steering, bad input is one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mlx_fun import jobs
from mlx_fun.model.io import load_model

from .cli_helpers import expect_error
from .cli_helpers import run as cli
from .conftest import FAMILIES


def _samples(vocab: int, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(lo, hi, size=int(rng.integers(5, 24))).tolist() for _ in range(n)]


@pytest.mark.parametrize("family,bits", [(f, None) for f in FAMILIES] + [("qwen3_moe", 4), ("deepseek_v3", 4)])
def test_scan_counts_equal_collect(make_model, family, bits):
    from mlx_fun.adapters import get_adapter
    from mlx_fun.observe.collect import collect
    from mlx_fun.observe.differential import scan

    model, _, config = load_model(make_model(family, bits=bits))
    adapter = get_adapter(model, config)
    samples = _samples(config.get("vocab_size") or 256, 6, 3, 200, seed=1)
    tap = scan(model, adapter, samples, batch_size=3)
    acc = collect(model, adapter, samples, batch_size=2, norms=False)
    assert tap.tokens == acc.total_tokens == sum(map(len, samples))
    np.testing.assert_array_equal(tap.count, acc.freq)
    np.testing.assert_allclose(tap.weight_sum, acc.weighted_freq_sum, rtol=1e-4, atol=1e-5)
    means = tap.means()
    np.testing.assert_allclose(means["activation_rate"].sum(axis=1), adapter.top_k)
    assert np.isfinite(means["mean_gate_logit"]).all()


def _jsonl(path, rows):
    path.write_text("".join(json.dumps({"content": " ".join(map(str, r))}) + "\n" for r in rows))
    return path


def test_domain_scan_finds_a_synthetic_domain_and_prune_protects_it(make_model, tmp_path):
    """Domain = texts of one half of the byte alphabet, general = the other half: the experts whose routing
    differs most are in the report, on the right side, and prune --domain-map never removes a domain expert."""
    path = make_model("qwen3_moe")
    (tmp_path / "domain.jsonl").write_text("".join(json.dumps({"content": "".join(
        "abcdefghijklm"[(i * 7 + j) % 13] for j in range(40))}) + "\n" for i in range(24)))
    (tmp_path / "general.jsonl").write_text("".join(json.dumps({"content": "".join(
        "NOPQRSTUVWXYZ"[(i * 5 + j) % 13] for j in range(40))}) + "\n" for i in range(24)))
    r = cli("domain-scan", "--model", path, "--domain-dataset", tmp_path / "domain.jsonl", "--general-dataset",
            tmp_path / "general.jsonl", "--domain-name", "letters", "--output", tmp_path / "domain_report.json",
            "--max-samples", 24)
    assert r.exit_code == 0, r.output
    rep = json.loads((tmp_path / "domain_report.json").read_text())
    assert rep["domain_name"] == "letters" and rep["domain_experts"] and rep["general_experts"]
    risk, comp = np.array(rep["scores"]["risk_difference"]), np.array(rep["scores"]["composite"])
    layers = rep["moe_layer_indices"]
    for key, sign in (("domain_experts", 1), ("general_experts", -1)):
        for layer, experts in rep[key].items():
            assert all(sign * risk[layers.index(int(layer)), e] > 0 for e in experts)
    top = np.unravel_index(np.argmax(comp), comp.shape)  # the most domain-leaning expert is a domain expert
    assert top[1] in rep["domain_experts"][str(layers[top[0]])]
    assert rep["datasets"]["domain"]["tokens"] > 0 and rep["per_dataset"]["general"]["tokens"] > 0
    saliency = tmp_path / "s.npz"
    assert cli("collect", "--model", path, "--dataset", tmp_path / "general.jsonl", "--output", saliency).exit_code == 0
    r = cli("prune", "--model", path, "--saliency", saliency, "--n-prune", 4, "--metric", "freq", "--domain-map",
            tmp_path / "domain_report.json", "--domain-mode", "protect", "--output", tmp_path / "pruned")
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "pruned" / "reap_metadata.json").read_text())
    for layer, experts in rep["domain_experts"].items():
        assert set(experts) <= set(meta["keep_map"][layer]), layer


def test_safety_scan_on_the_refusing_model(tmp_path):
    from mlx_fun.model.io import bundled_model_dir

    chat = bundled_model_dir().parent / "tiny-moe-chat"
    safety = bundled_model_dir().parent / "safety"
    got = jobs.safety_scan.run(model=chat, harmful_dataset=safety / "harmful_train.jsonl",
                               benign_dataset=safety / "benign_train.jsonl", output=tmp_path / "safety_report.json",
                               max_samples=48, seed=0)
    rep = json.loads((tmp_path / "safety_report.json").read_text())
    assert rep == got.report and rep["format"] == "mlx-fun safety report"
    for layer in rep["safety_critical"]:
        assert set(rep["safety_critical"][layer]) == set(rep["hcdg"].get(layer, [])) | set(rep["hrcg"].get(layer, []))
    sizes = got.group_sizes()
    assert sizes["hcdg"] > 0 and sizes["hrcg"] > 0
    assert rep["datasets"]["harmful"]["samples"] == 48 and rep["thresholds"]["hcdg_risk_difference_at_least"] > 0
    # ranked as SteerMoE ranks: by the risk difference over all layers, each side past its percentile
    risk = np.array(rep["scores"]["risk_difference"])
    assert rep["ranked_by"] == "risk_difference" and rep["threshold_percentile"] == 90.0
    hcdg = {(p, e) for p, layer in enumerate(rep["moe_layer_indices"]) for e in rep["hcdg"].get(str(layer), [])}
    assert hcdg == {(p, e) for p, e in zip(*np.nonzero((risk >= np.percentile(risk, 90)) & (risk > 0)))}
    hrcg = {(p, e) for p, layer in enumerate(rep["moe_layer_indices"]) for e in rep["hrcg"].get(str(layer), [])}
    assert hrcg == {(p, e) for p, e in zip(*np.nonzero((risk <= np.percentile(risk, 10)) & (risk < 0)))}
    from mlx_fun.experts.expert_files import load_report_experts
    from mlx_fun.experts.steering import from_reports

    sets = load_report_experts(tmp_path / "safety_report.json", "safety", [0, 1, 2, 3], 48)
    assert sum(map(len, sets.values())) == sizes["safety_critical"]
    s = from_reports(moe_layer_indices=[0, 1, 2, 3], num_experts=48, top_k=6,
                     safety_map=tmp_path / "safety_report.json", safety_mode="unsafe")
    assert sum(map(len, s.deactivate.values())) == sizes["hcdg"]


def test_scan_errors_are_one_line(tmp_path, make_model):
    path = make_model("qwen3_moe")
    data = _jsonl(tmp_path / "d.jsonl", [[1, 2, 3]])
    expect_error(cli("safety-scan", "--model", path, "--harmful-dataset", tmp_path / "none.jsonl", "--benign-dataset",
                     data, "--output", tmp_path / "r.json"), "--harmful-dataset", "does not exist")
    r = cli("safety-scan", "--model", path, "--harmful-dataset", data, "--benign-dataset", data, "--output",
            tmp_path / "r.json", "--threshold-percentile", 100)
    assert r.exit_code == 2 and "threshold-percentile" in r.output
    expect_error(cli("domain-scan", "--model", path, "--domain-dataset", data, "--general-dataset", data,
                     "--domain-name", " ", "--output", tmp_path / "r.json"), "--domain-name")
    expect_error(cli("domain-scan", "--model", path, "--domain-dataset", data, "--general-dataset", data,
                     "--domain-name", "x", "--output", path), "--output")
    assert not (tmp_path / "r.json").exists()
