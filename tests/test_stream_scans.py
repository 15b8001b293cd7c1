"""Issue 43: layer-streamed differential scans (``safety-scan`` / ``domain-scan --stream-layers``): both datasets
carried together through one streamed forward (each layer's weights read once), the in-memory report (counts
exactly, scores to float rounding)."""

from __future__ import annotations


import json

import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_fun.errors import UserError, cli_names
from mlx_fun.observe.differential import report, scan, scan_streamed

from .cli_helpers import full_and_lazy, interrupting_checkpoint
from .conftest import FAMILIES

HARMFUL = [list(range(5, 21)), list(range(40, 56))]  # 2 samples × 16 tokens per dataset
BENIGN = [list(range(60, 76)), list(range(21, 37))]
KEYS = ("count", "weight_sum", "logit_sum")


def _reports(path, model_type):
    """The in-memory report of a fully loaded model and the streamed one of a lazily loaded copy."""
    model, adapter, lazy, ladapter = full_and_lazy(path)
    if ladapter.layerwise_blocker():
        with cli_names(), pytest.raises(UserError, match=f"which {model_type} does not allow: .*; run it without "
                                                         "--stream-layers"):
            scan_streamed(lazy, ladapter, [HARMFUL, BENIGN], batch_size=2)
        return None
    full = [scan(model, adapter, s, batch_size=2) for s in (HARMFUL, BENIGN)]
    streamed = scan_streamed(lazy, ladapter, [HARMFUL, BENIGN], batch_size=2)
    for i, layer in enumerate(ladapter.decoder_layers()[: ladapter.moe_layers()[-1] + 1]):  # every one released
        assert all(p.size == 0 for _, p in tree_flatten(layer.parameters())), i
    for a, b in zip(full, streamed):
        assert a.tokens == b.tokens == 32
        assert np.array_equal(a.count, b.count)
        for key in KEYS[1:]:
            np.testing.assert_allclose(getattr(b, key), getattr(a, key), rtol=1e-5, atol=1e-5, err_msg=key)
    return [report("safety", *taps, a, percentile=90.0, datasets={})
            for taps, a in ((full, adapter), (streamed, ladapter))]


def _assert_same_report(full: dict, streamed: dict) -> None:
    for key in full:
        if key in ("scores", "per_dataset"):
            continue
        want = pytest.approx(full[key], rel=1e-5, abs=1e-6) if key == "thresholds" else full[key]
        assert streamed[key] == want, key
    for k, v in full["scores"].items():
        np.testing.assert_allclose(streamed["scores"][k], v, rtol=1e-4, atol=2e-6, err_msg=k)
    for name, means in full["per_dataset"].items():
        for k, v in means.items():
            np.testing.assert_allclose(streamed["per_dataset"][name][k], v, rtol=1e-5, atol=2e-6, err_msg=k)


@pytest.mark.parametrize("bits", [None, 4], ids=["float", "q4"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_streamed_scan_equals_the_in_memory_scan(make_model, model_type, bits):
    kw = {"n_group": 1, "topk_group": 1} if model_type in ("deepseek_v3", "deepseek_v32") else {}
    reports = _reports(make_model(model_type, bits=bits, **kw), model_type)
    if reports is not None:  # else refused (deepseek_v41)
        _assert_same_report(*reports)


def test_a_family_that_cannot_stream_is_refused(make_model):
    assert _reports(make_model("deepseek_v41"), "deepseek_v41") is None


# ---------------------------------------------------------------------------------------------- the jobs
from mlx_fun import jobs  # noqa: E402
from mlx_fun.model.io import bundled_model_dir  # noqa: E402
from mlx_fun.runtime import memory  # noqa: E402

from .cli_helpers import expect_error  # noqa: E402
from .cli_helpers import run as cli  # noqa: E402

SAFETY = bundled_model_dir().parent / "safety"


def _letters(path, letters: str, step: int):
    path.write_text("".join(json.dumps({"content": "".join(letters[(i * step + j) % len(letters)] for j in range(40))})
                            + "\n" for i in range(8)))
    return path


def test_safety_scan_stream_layers_writes_the_in_memory_report(tmp_path):
    chat = bundled_model_dir().parent / "tiny-moe-chat"
    reports = []
    for name, flag in (("mem", "--no-stream-layers"), ("stream", "--stream-layers")):
        r = cli("safety-scan", "--model", chat, "--harmful-dataset", SAFETY / "harmful_train.jsonl", "--benign-dataset",
                SAFETY / "benign_train.jsonl", "--output", tmp_path / f"{name}.json", "--max-samples", 12, "--seed", 0,
                flag)
        assert r.exit_code == 0, r.output
        reports.append(json.loads((tmp_path / f"{name}.json").read_text()))
    assert not (tmp_path / ".stream.json.stream").exists()  # the checkpoint, removed once the report is written
    full, streamed = reports
    assert streamed["datasets"]["harmful"]["path"] == full["datasets"]["harmful"]["path"]
    assert [d["tokens"] for d in streamed["datasets"].values()] == [d["tokens"] for d in full["datasets"].values()]
    assert full["hcdg"] and full["hrcg"]
    _assert_same_report(full, streamed)


def test_domain_scan_stream_layers_writes_the_in_memory_report(tmp_path, make_model, monkeypatch):
    """The streamed scan here also spills its hidden states (the memory left too small for them beside a layer)."""
    model = make_model("gpt_oss", bits=4)
    domain = _letters(tmp_path / "domain.jsonl", "abcdefghijklm", 7)
    general = _letters(tmp_path / "general.jsonl", "NOPQRSTUVWXYZ", 5)
    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)
    reports = []
    for name, flag in (("mem", "--no-stream-layers"), ("stream", "--stream-layers")):
        r = cli("domain-scan", "--model", model, "--domain-dataset", domain, "--general-dataset", general,
                "--domain-name", "letters", "--output", tmp_path / f"{name}.json", "--batch-size", 3, flag)
        assert r.exit_code == 0, r.output
        assert ("spilling them to files on disk" in r.output) == (name == "stream"), r.output
        reports.append(json.loads((tmp_path / f"{name}.json").read_text()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["domain.jsonl", "general.jsonl", "mem.json", "stream.json"]
    assert reports[0]["domain_experts"] and reports[0]["domain_name"] == reports[1]["domain_name"] == "letters"
    _assert_same_report(*reports)


def test_a_scan_of_a_family_that_cannot_stream_is_refused_in_one_line(tmp_path, make_model):
    model = make_model("deepseek_v41")
    data = _letters(tmp_path / "d.jsonl", "abcdef", 1)
    expect_error(cli("safety-scan", "--model", model, "--harmful-dataset", data, "--benign-dataset", data,
                     "--output", tmp_path / "r.json", "--stream-layers"),
                 "a streamed safety-scan runs the model one decoder layer at a time, which deepseek_v41 does not allow",
                 "run it without --stream-layers")
    assert not (tmp_path / "r.json").exists()


def test_a_scan_streams_by_itself_when_the_weights_exceed_the_memory_left(tmp_path, make_model, monkeypatch):
    data = _letters(tmp_path / "d.jsonl", "abcdefghij", 3)

    def scan(model_type, name):  # the run's note, "" without one
        lines = []
        jobs.safety_scan.run(model=make_model(model_type), harmful_dataset=data, benign_dataset=data,
                             output=tmp_path / name, max_samples=2, seed=0, log=lines.append)
        return "".join(line for line in lines if line.startswith("Note:"))

    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)
    assert "exceed the memory left" in (note := scan("qwen3_moe", "a.json")) and "streaming the layers" in note
    note = scan("deepseek_v41", "b.json")
    assert "deepseek_v41 cannot run one layer at a time (its " in note and note.endswith(": scanning in memory."), note
    monkeypatch.setattr(memory, "available_bytes", lambda: 1 << 40)
    assert scan("qwen3_moe", "c.json") == ""
    assert json.loads((tmp_path / "a.json").read_text())["scores"] == json.loads((tmp_path / "c.json").read_text())["scores"]


def test_a_streamed_scan_interrupted_after_a_layer_resumes_there_with_the_same_sums(tmp_path, make_model):
    """A checkpoint after every layer (``EVERY = 0``); interrupted once layer 1 is saved, a second run with the
    same checkpoint resumes at layer 2 and ends with the uninterrupted run's sums, bit for bit."""
    path = make_model("qwen3_moe", num_hidden_layers=4)

    def lazy():
        return full_and_lazy(path)[2:]

    whole = scan_streamed(*lazy(), [HARMFUL, BENIGN], batch_size=2)

    def checkpoint(stop_after=None):
        return interrupting_checkpoint(tmp_path / "ck", "safety-scan", stop_after)

    with pytest.raises(KeyboardInterrupt):
        scan_streamed(*lazy(), [HARMFUL, BENIGN], batch_size=2, checkpoint=checkpoint(stop_after=1))
    said = []
    resumed = scan_streamed(*lazy(), [HARMFUL, BENIGN], batch_size=2, checkpoint=checkpoint(), log=said.append)
    assert said == [f"Resuming at layer 2 of 4 from {tmp_path / 'ck'}."]
    for a, b in zip(whole, resumed):
        assert a.tokens == b.tokens == 32
        for key in KEYS:  # the counts, the router-weight and gate-logit sums
            assert np.array_equal(getattr(a, key), getattr(b, key)), key
