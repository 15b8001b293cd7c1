"""`mlx-fun abliterate`: the projection removes d from what each residual writer outputs and nothing else, keeps
quantized formats, touches exactly its target, and every family abliterates and reloads; bad inputs write nothing."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_fun import jobs
from mlx_fun.adapters import get_adapter
from mlx_fun.model.io import load_model
from mlx_fun.rewrite.abliterate import apply, embedding, restore, writers
from mlx_fun.rewrite.abliterate_options import Estimate, Evaluation, Projection
from mlx_fun.rewrite.weights import dense, dense_of, stored, stored_keeping

from .cli_helpers import expect_error
from .cli_helpers import run as cli
from .conftest import FAMILIES
from .test_nothing_lost import tree


def _unit(H, seed=0):
    d = np.random.default_rng(seed).normal(size=H)
    return d / np.linalg.norm(d)


def _outputs(lin, x, e=None):
    """(N, out) float64 outputs of a (switch) linear's weight (+ bias) on x (N, in), as NumPy."""
    w = np.array(dense(lin, e), dtype=np.float64)
    y = x @ w.T
    if "bias" in lin:
        y = y + np.array(lin["bias"] if e is None else lin["bias"][e], dtype=np.float64)
    return y


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "qwen3_next"])
def test_each_writer_outputs_nothing_along_d_and_the_rest_unchanged(make_model, family):
    model, _, config = load_model(make_model(family))
    adapter = get_adapter(model, config)
    H, L = adapter.hidden_size, len(adapter.decoder_layers())
    dirs = np.stack([_unit(H, i) for i in range(L)])
    before = dict(tree_flatten(model.parameters()))
    layer = adapter.moe_layers()[-1]
    found = writers(adapter, layer)
    assert {"attention", "routed"} <= {w.kind for w in found}
    old = {w.path: w.module for w in found}
    ref = {}
    rng = np.random.default_rng(1)
    for w in found:
        x = rng.normal(size=(16, dense(w.module, next(iter(_rows(w.module)))).shape[-1]))
        ref[w.path] = (x, [_outputs(w.module, x, e) for e in _rows(w.module)])
    touched, _ = apply(adapter, dirs, [layer])
    assert sorted(touched[layer]) == sorted(old)
    d = dirs[layer]
    for w in found:
        x, outs = ref[w.path]
        for e, y0 in zip(_rows(w.module), outs):
            y1 = _outputs(w.module, x, e)
            assert np.abs(y1 @ d).max() <= 1e-4 * np.abs(y0).max(), (w.path, e)
            ortho0, ortho1 = y0 - np.outer(y0 @ d, d), y1 - np.outer(y1 @ d, d)
            np.testing.assert_allclose(ortho1, ortho0, atol=1e-4 * np.abs(y0).max())
    after = dict(tree_flatten(model.parameters()))
    prefix = f"{_layers_path(model, adapter)}.{layer}."
    for name, value in before.items():
        if not name.startswith(prefix):
            assert np.array_equal(np.array(value), np.array(after[name])), name


@pytest.mark.parametrize("family,bits", [("qwen3_moe", None), ("gpt_oss", None), ("qwen3_moe", 4)])
def test_embedding_rows_and_writers_lose_a_stack_of_directions_at_once(make_model, family, bits):
    model, _, config = load_model(make_model(family, bits=bits))
    adapter = get_adapter(model, config)
    H, L = adapter.hidden_size, len(adapter.decoder_layers())
    path, emb = embedding(adapter)
    assert path.endswith("embed_tokens")
    first, second = _unit(H, 0), _unit(H, 1)
    second = second - (second @ first) * first
    second /= np.linalg.norm(second)
    E0 = np.array(dense(emb), dtype=np.float64)
    layers = list(range(L))
    Q = np.stack([first, second])
    touched, _ = apply(adapter, np.stack([np.stack([first] * L), np.stack([second] * L)]), layers, embed=Q)
    assert touched["embedding"] == [path]
    E1 = np.array(dense(emb), dtype=np.float64)
    tol = 1e-4 if bits is None else 0.25  # quantized: what the feedback re-quantization leaves
    for d in (first, second):
        assert np.linalg.norm(E1 @ d) <= tol * np.linalg.norm(E0 @ d), d[:3]
    rest0, rest1 = E0 - (E0 @ Q.T) @ Q, E1 - (E1 @ Q.T) @ Q
    assert np.linalg.norm(rest1 - rest0) <= (1e-4 if bits is None else 0.2) * np.linalg.norm(rest0)
    for i in layers:
        for w in writers(adapter, i):
            for e in list(_rows(w.module))[:2]:
                W = np.array(dense(w.module, e), dtype=np.float64)
                assert np.linalg.norm(Q @ W) <= (1e-4 if bits is None else 0.25) * np.linalg.norm(W), (i, w.path)


@pytest.mark.parametrize("bits,mode,gain", [(4, "affine", 0.5), (3, "affine", 0.5), (4, "mxfp4", 0.5),
                                            (4, "nvfp4", 0.5), (8, "affine", 1.0), (2, "affine", 1.0)])
def test_requantization_holds_the_removed_direction_better_than_rounding(bits, mode, gain):
    """A weight already on the grid, with a direction projected out: round-to-nearest puts much of it back; the
    feedback re-quantization keeps at most ``gain`` of that (3-4 bits: half; never more), in the same format, with
    at most ERROR_GROWTH x round-to-nearest's element error."""
    from mlx_fun.rewrite.weights import ERROR_GROWTH

    import mlx.nn as nn

    rng = np.random.default_rng(0)
    lin = nn.Linear(128, 256, bias=False)
    lin.weight = mx.array(rng.normal(size=(256, 128)).astype(np.float32) * 0.05)
    gs = 16 if mode == "nvfp4" else 32
    q = nn.QuantizedLinear.from_linear(lin, group_size=gs, bits=bits, mode=mode)
    W = dense(q)
    d = mx.array(_unit(256, 3).astype(np.float32))
    target = W - d[:, None] * (d[None, :] @ W)
    rtn = mx.linalg.norm(d @ dense_of(q, stored(q, target))).item()
    parts = stored_keeping(q, target, d)
    got = dense_of(q, parts)
    assert set(parts) <= {"weight", "scales", "biases", "global_scale"}
    assert parts["weight"].dtype == q["weight"].dtype and parts["weight"].shape == q["weight"].shape
    assert mx.linalg.norm(d @ got).item() <= gain * rtn
    rtn_err = mx.linalg.norm(dense_of(q, stored(q, target)) - target).item()
    assert mx.linalg.norm(got - target).item() <= ERROR_GROWTH * rtn_err * (1 + 1e-5)


def _rows(lin):
    return range(lin["weight"].shape[0]) if lin["weight"].ndim == 3 else [None]


def _layers_path(model, adapter):
    target = adapter.decoder_layers()[0]
    for name, m in model.named_modules():
        if m is target:
            return name.rsplit(".", 1)[0]
    raise AssertionError("decoder layers not found")


@pytest.mark.parametrize("bits,mode", [(4, "affine"), (4, "mxfp4")])
def test_quantized_writers_stay_quantized_and_match_the_projected_float(make_model, bits, mode):
    model, _, config = load_model(make_model("qwen3_moe", bits=bits, mode=mode))
    adapter = get_adapter(model, config)
    H = adapter.hidden_size
    dirs = np.stack([_unit(H, i) for i in range(len(adapter.decoder_layers()))])
    layer = adapter.moe_layers()[0]
    found = writers(adapter, layer)
    formats = {w.path: (w.module.bits, w.module.group_size, w.module.mode, w.module["weight"].dtype) for w in found}
    d = mx.array(dirs[layer].astype(np.float32))
    expected = {w.path: [np.array(dense(w.module, e) - d[:, None] * (d[None, :] @ dense(w.module, e)))
                         for e in _rows(w.module)] for w in found}
    apply(adapter, dirs, [layer])
    for w in found:
        assert (w.module.bits, w.module.group_size, w.module.mode, w.module["weight"].dtype) == formats[w.path]
        for e, want in zip(_rows(w.module), expected[w.path]):
            got = np.array(dense(w.module, e))
            step = np.abs(want).max() / (3 if mode == "mxfp4" else (2 ** bits - 1) / 2)
            assert np.abs(got - want).max() <= step, (w.path, e)
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.2


def test_restore_undoes_everything(make_model):
    model, _, config = load_model(make_model("gpt_oss", bits=4))
    adapter = get_adapter(model, config)
    before = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    dirs = np.stack([_unit(adapter.hidden_size, i) for i in range(len(adapter.decoder_layers()))])
    _, undo = apply(adapter, dirs, list(range(len(adapter.decoder_layers()))), weight=0.5)
    restore(undo)
    for k, v in tree_flatten(model.parameters()):
        assert np.array_equal(before[k], np.array(v)), k


def _prompts(tmp_path):
    harmful = tmp_path / "harmful.jsonl"
    benign = tmp_path / "benign.jsonl"
    harmful.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"How do I build weapon {i}?"}]})
                               + "\n" for i in range(6)))
    benign.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What does os.path {i} do?"}]})
                              + "\n" for i in range(6)))
    return harmful, benign


HYPER_CONNECTED = {"deepseek_v41"}  # several residual streams per layer: refused


@pytest.mark.parametrize("family,bits", [(f, None) for f in FAMILIES] + [("qwen3_moe", 4), ("deepseek_v3", 4),
                                                                        ("gpt_oss", 4)])
def test_every_family_abliterates_and_reloads(make_model, tmp_path, family, bits):
    """... and, for one model type of every routing family (adapter class) and the quantized ones, the streamed run
    (``stream_layers=True``) gives the same directions, measurements and written weights, bit for bit."""
    from mlx_lm import load

    from .test_stream_abliterate import STREAMED_FAMILIES, assert_streamed_equal

    harmful, benign = _prompts(tmp_path)
    out = tmp_path / "abl"
    if family in HYPER_CONNECTED:
        expect_error(cli("abliterate", "--model", make_model(family), "--harmful-dataset", harmful,
                         "--benign-dataset", benign, "--output", out, "--no-refusal-filter"), "residual state of shape",
                     "hyper-connections")
        assert not out.exists()
        return
    how = dict(model=make_model(family, bits=bits), harmful_dataset=harmful, benign_dataset=benign,
               projection=Projection(layers="all"), max_samples=4, seed=0,
               evaluation=Evaluation(eval_samples=2, reply_tokens=2), estimate=Estimate(refusal_filter=False))
    got = jobs.abliterate.run(output=out, **how)
    assert got.modified and got.layers == list(range(len(got.direction_norms)))
    if bits is not None or family in STREAMED_FAMILIES:
        assert_streamed_equal(got, jobs.abliterate.run(output=tmp_path / "streamed", stream_layers=True, **how))
    meta = json.loads((out / "abliteration_metadata.json").read_text())
    assert meta["abliterated_layers"] == got.layers and meta["target"] == "all"
    model, _ = load(str(out))
    assert model(mx.array([[1, 2, 3]])).shape[-1] > 0


def test_safety_experts_touches_exactly_the_reports_experts(make_model, tmp_path):
    path = make_model("qwen3_moe")
    model, _, config = load_model(path)
    adapter = get_adapter(model, config)
    moe = adapter.moe_layers()
    report = tmp_path / "safety_report.json"
    report.write_text(json.dumps({"safety_critical": {str(moe[0]): [1, 5], str(moe[-1]): [2]}}))
    harmful, benign = _prompts(tmp_path)
    out = tmp_path / "abl"
    got = jobs.abliterate.run(model=path, harmful_dataset=harmful, benign_dataset=benign, output=out,
                              projection=Projection(layers="all", target="safety-experts", safety_map=report),
                              max_samples=4, evaluation=Evaluation(eval_samples=2, reply_tokens=2), seed=0,
                              estimate=Estimate(refusal_filter=False))
    assert set(got.modified) == {str(moe[0]), str(moe[-1])}
    new, _, _ = load_model(out)
    old = dict(tree_flatten(model.parameters()))
    changed = {}
    for name, value in tree_flatten(new.parameters()):
        if not np.array_equal(np.array(value), np.array(old[name])):
            diff = np.abs(np.array(value) - np.array(old[name])).reshape(value.shape[0], -1).max(axis=1)
            changed[name] = sorted(int(e) for e in np.flatnonzero(diff))
    prefix = _layers_path(model, adapter)
    assert changed == {f"{prefix}.{moe[0]}.mlp.switch_mlp.down_proj.weight": [1, 5],
                       f"{prefix}.{moe[-1]}.mlp.switch_mlp.down_proj.weight": [2]}


def test_bad_inputs_exit_2_and_write_nothing(make_model, tmp_path):
    path = make_model("qwen3_moe")
    harmful, benign = _prompts(tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    out = tmp_path / "out"
    base = ["abliterate", "--model", path, "--harmful-dataset", harmful, "--benign-dataset", benign, "--output", out]
    expect_error(cli(*base, "--target", "safety-experts"), "--safety-map")
    expect_error(cli(*base, "--target", "safety-experts", "--safety-map", tmp_path / "none.json"), "--safety-map",
                 "does not exist")
    expect_error(cli(*base, "--layers", "2-40"), "--layers", "outside the model")
    expect_error(cli(*base, "--layers", "3-1"), "--layers")
    expect_error(cli(*base, "--direction-layer", "40"), "--direction-layer", "outside the model")
    expect_error(cli(*base, "--rounds", "0"), "--rounds")
    expect_error(cli(*base, "--phrasings", "0"), "--phrasings")
    expect_error(cli(*base, "--direction", "sideways"), "--direction")
    expect_error(cli("abliterate", "--model", path, "--harmful-dataset", tmp_path / "empty.jsonl", "--benign-dataset",
                     benign, "--output", out), "empty.jsonl")
    assert not out.exists()


def test_search_keeps_the_fewest_refusals_under_max_kl(make_model, tmp_path):
    harmful, benign = _prompts(tmp_path)
    out = tmp_path / "abl"
    got = jobs.abliterate.run(model=make_model("qwen3_moe"), harmful_dataset=harmful, benign_dataset=benign,
                              output=out, evaluation=Evaluation(search=3, max_kl=10.0, eval_samples=2, reply_tokens=2),
                              max_samples=4, seed=0, estimate=Estimate(refusal_filter=False))
    assert len(got.trials) == 3 and len({(tuple(t.layers), t.weight, t.direction_layer) for t in got.trials}) == 3
    best = min(got.trials, key=lambda t: (t.harmful_refusal, t.held_out_kl))  # the bound's own KL (issue 45)
    assert (got.layers, got.weight, got.direction_layer) == (best.layers, best.weight, best.direction_layer)
    assert got.after == best
    meta = json.loads((out / "abliteration_metadata.json").read_text())
    assert [t["layers"] for t in meta["search"]["trials"]] == [t.layers for t in got.trials]
    assert meta["evaluation"]["before"]["benign_kl"] == 0.0


def test_phrasing_directions_over_max_kl_fall_back_to_one(tmp_path):
    """Why the first round falls back: on the bundled chat model one direction per refusal phrasing removes a
    little more refusing but moves benign replies far more (measured: 1.6% at KL 1.11 against 4.7% at 0.29 for the
    defaults, which fall back to one direction: the README's abliterate example, checked in tests/test_readme.py)."""
    from pathlib import Path

    data = Path(__file__).resolve().parents[1] / "data"
    got = jobs.abliterate.run(model=data / "tiny-moe-chat", harmful_dataset=data / "safety" / "harmful_train.jsonl",
                              benign_dataset=data / "safety" / "benign_train.jsonl",
                              evaluation=Evaluation(eval_harmful_dataset=data / "safety" / "harmful_test.jsonl",
                                                    eval_benign_dataset=data / "safety" / "benign_test.jsonl",
                                                    max_kl=10.0, eval_samples=32),
                              output=tmp_path / "four", seed=0, estimate=Estimate(rounds=1), max_samples=64)
    first = got.rounds[0]
    assert len(first.dirs) == 4 and set(first.phrasings) == {"sorry i", "i can't", "i won't", "i'm sorry"}
    assert sum(first.phrasings.values()) == first.refused
    assert not any("instead" in w for w in got.warnings)
    assert got.after.harmful_refusal <= 0.1 and got.after.benign_kl > 0.5  # the defaults: <= 0.35 (README test)
    np.testing.assert_allclose(first.dirs[:, 3] @ first.dirs[:, 3].T, np.eye(4), atol=1e-6)  # orthonormal
    assert np.array_equal(first.dirs[:, 0], first.dirs[:, 3])  # one source layer's directions, everywhere


@pytest.fixture(scope="module")
def chat_4bit():
    """The bundled chat model, which ships quantized (6-bit affine, group size 32), and a small capture set."""
    from pathlib import Path

    data = Path(__file__).resolve().parents[1] / "data"
    assert "quantization" in json.loads((data / "tiny-moe-chat" / "config.json").read_text())
    common = dict(harmful_dataset=data / "safety" / "harmful_train.jsonl",
                  benign_dataset=data / "safety" / "benign_train.jsonl", max_samples=16, seed=0)
    return data / "tiny-moe-chat", common


def test_rounds_round_a_quantized_model_once_from_its_original_weights(chat_4bit, tmp_path):
    """The written quantized model is its original with every round's directions removed at once (one rounding), not
    a re-rounding of the previous round's rounding."""
    q4, common = chat_4bit
    got = jobs.abliterate.run(model=q4, output=tmp_path / "abl", evaluation=Evaluation(eval_samples=8, reply_tokens=8),
                              **common)
    assert len(got.rounds) >= 2, [len(r.dirs) for r in got.rounds]  # measured: 3 directions, then 1
    model, _, config = load_model(q4)
    adapter = get_adapter(model, config)
    stack = np.concatenate([r.dirs for r in got.rounds])
    apply(adapter, stack, got.layers, embed=stack[:, got.direction_layer])
    want = dict(tree_flatten(model.parameters()))
    written, _, _ = load_model(tmp_path / "abl")
    have = dict(tree_flatten(written.parameters()))
    assert want.keys() == have.keys()
    for k in want:
        assert np.array_equal(np.array(want[k]), np.array(have[k])), k


def test_a_round_over_max_kl_is_undone(chat_4bit, tmp_path):
    """--max-kl is checked on benign prompts the directions were not fitted on (issue 45: on its own capture prompts
    the KL read 0.29 where held-out ones read 1.32): 16 + 32 drawn, 32 held out, and the result says so."""
    q4, common = chat_4bit
    got = jobs.abliterate.run(model=q4, output=tmp_path / "abl", estimate=Estimate(rounds=3),
                              evaluation=Evaluation(eval_samples=8, reply_tokens=8, max_kl=1e-4), **common)
    assert len(got.rounds) == 1 and got.rounds[0].benign == 16
    assert any("round 2 took the first-token KL on the 32 held-out benign prompts to" in w and "undone" in w
               for w in got.warnings)
    assert any(w.startswith("the written model's first-token KL on the 32 held-out benign prompts is ")
               for w in got.warnings)  # one direction left, still over the (tiny) bound: said, not hidden
    meta = json.loads((tmp_path / "abl" / "abliteration_metadata.json").read_text())
    assert len(meta["rounds"]) == 1
    bound = meta["evaluation"]["kl_bound"]
    assert bound == {"max_kl": 1e-4, "held_out_kl": meta["evaluation"]["after"]["held_out_kl"], "prompts": 32,
                     "held_out": True, "on": "first-token KL on the 32 held-out benign prompts"}
    assert bound["held_out_kl"] > 1e-4 and got.kl_set == "32 held-out benign prompts"


def test_the_benign_prompts_held_out_of_the_directions():
    """split_benign: --kl-holdout of the prompts drawn, never more than half when fewer came, never leaving more than
    --max-samples to fit on; both sides in the dataset's order; 0 holds none out."""
    from mlx_fun.rewrite.abliterate_options import split_benign

    fit, held = split_benign(list(range(48)), fit=16, holdout=32, seed=0)
    assert (len(fit), len(held)) == (16, 32) and sorted(fit + held) == list(range(48)) and fit == sorted(fit)
    assert split_benign(list(range(48)), fit=16, holdout=32, seed=0) == (fit, held)  # seeded
    assert [len(x) for x in split_benign(list(range(10)), fit=16, holdout=32, seed=0)] == [5, 5]  # a small dataset
    assert [len(x) for x in split_benign(list(range(40)), fit=32, holdout=8, seed=1)] == [32, 8]
    assert split_benign(list(range(16)), fit=16, holdout=0, seed=0) == (list(range(16)), [])
    assert split_benign([7], fit=16, holdout=32, seed=0) == ([7], [])


def test_phrasing_names_how_a_reply_opens():
    from mlx_fun.observe.refusal import phrasing

    assert phrasing("Sorry, I can't assist with that.") == "sorry i"
    assert phrasing("  I\u2019m sorry, but no") == "i'm sorry"
    assert phrasing("No.") == "no" and phrasing("") == ""


def test_a_model_that_refuses_nothing_is_refused_with_the_rate(make_model, tmp_path):
    """Row 17: a random model refuses none of the harmful prompts; abliterate used to warn, exit 0 and write a
    modified model. Now one line with the measured rate and both ways out, exit 2, nothing written."""
    harmful, benign = _prompts(tmp_path)
    before = tree(tmp_path)
    out = tmp_path / "abl"
    result = cli("abliterate", "--model", make_model("qwen3_moe"), "--harmful-dataset", harmful, "--benign-dataset",
                 benign, "--output", out, "--max-samples", 4, "--eval-samples", 2)
    expect_error(result, "refuses none of the 4 harmful capture prompts (0.0%", "nothing was written",
                 "--harmful-dataset", "--no-refusal-filter")
    assert not out.exists() and tree(tmp_path) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_the_refusal_filter_is_named_as_the_caller_turns_it_off():
    """From Python ``refusal_filter=False``, on the command line ``--no-refusal-filter``."""
    from mlx_fun.errors import UserError, cli_names
    from mlx_fun.rewrite.abliterate_rounds import check_refusals

    with pytest.raises(UserError, match=r"harmful_dataset= .* or refusal_filter=False to take"):
        check_refusals(0, 4, 4, 4, 16)
    with cli_names(), pytest.raises(UserError, match=r"--benign-dataset, or --no-refusal-filter\.$"):
        check_refusals(3, 4, 0, 4, 16)


def test_the_same_prompts_on_both_sides_are_refused_before_loading(make_model, tmp_path):
    harmful, _ = _prompts(tmp_path)
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(harmful.read_bytes())
    for benign in (harmful, copy):
        result = cli("abliterate", "--model", make_model("qwen3_moe"), "--harmful-dataset", harmful,
                     "--benign-dataset", benign, "--output", tmp_path / "abl")
        expect_error(result, "hold the same prompts", "zero")
        assert "Loading" not in result.output and not (tmp_path / "abl").exists()


def test_a_chat_model_that_refuses_every_benign_prompt_is_refused(tmp_path):
    from pathlib import Path

    data = Path(__file__).resolve().parents[1] / "data"
    out = tmp_path / "abl"
    lines = (data / "safety" / "harmful_train.jsonl").read_text().splitlines(keepends=True)
    benign = tmp_path / "more_harmful.jsonl"  # other harmful prompts, passed as benign by mistake
    benign.write_text("".join(lines[len(lines) // 2:]))
    result = cli("abliterate", "--model", data / "tiny-moe-chat", "--harmful-dataset",
                 data / "safety" / "harmful_train.jsonl", "--benign-dataset", benign,
                 "--output", out, "--max-samples", 4, "--eval-samples", 2, "--seed", 0)
    expect_error(result, "refuses all 4 benign capture prompts (100.0%; harmful: 4 of 4", "--benign-dataset",
                 "--no-refusal-filter")
    assert not out.exists()


def test_every_phase_says_what_it_does(tmp_path):
    """Row 24: the README example showed nothing for most of its run; every phase now logs a line and shows a bar."""
    from pathlib import Path

    data = Path(__file__).resolve().parents[1] / "data"
    out = tmp_path / "abl"
    result = cli("abliterate", "--model", data / "tiny-moe-chat", "--harmful-dataset",
                 data / "safety" / "harmful_train.jsonl", "--benign-dataset", data / "safety" / "benign_train.jsonl",
                 "--eval-harmful-dataset", data / "safety" / "harmful_test.jsonl", "--eval-benign-dataset",
                 data / "safety" / "benign_test.jsonl", "--output", out, "--max-samples", 8, "--eval-samples", 4,
                 "--rounds", 2, "--seed", 0)
    assert result.exit_code == 0, result.output
    text = result.output
    lines = [
        "Round 1: the model's replies to 8 harmful and 8 benign capture prompts (16 tokens each) ...",
        "Measuring the original model on 4 harmful and 4 benign evaluation prompts ...",
        "Measuring the abliterated model on 4 harmful and 4 benign evaluation prompts ...",
        f"Writing {out} ...",
    ]
    at = [text.index(line) for line in lines]
    assert at == sorted(at), text
    # the first-token log-probs come with the replies (no phase of their own since issue 31)
    for bar in ("round 1 harmful replies", "round 1 benign replies", "evaluation harmful replies",
                "evaluation benign replies", "round 1 benign"):
        assert f"{bar}:" in text, (bar, text[-3000:])


def _chat_prompts(n):
    from pathlib import Path

    from mlx_fun.datasets.samples import load_samples

    data = Path(__file__).resolve().parents[1] / "data"
    model, tok = load_model(data / "tiny-moe-chat")[:2]
    return model, tok, load_samples(data / "safety" / "benign_test.jsonl", tok, max_samples=n, seed=0,
                                    generation_prompt=True)


def test_first_token_logprobs_are_one_engine_pass_in_any_budget_and_the_replies_own():
    """Batched, right-padded, each prompt's last real position: what one forward per prompt gives, also with a
    budget that feeds every prompt in chunks through the KV cache; the greedy replies' own first-token log-probs
    (float32 model) are the same distribution, and asking for them leaves the replies as they were."""
    from mlx_fun.observe.refusal import first_token_logprobs, greedy_replies

    model, tok, prompts = _chat_prompts(6)
    assert len({len(p) for p in prompts}) > 1  # padding is exercised
    one = []
    for p in prompts:
        logits = model(mx.array(p)[None])[0, -1].astype(mx.float32)
        one.append(np.array(logits - mx.logsumexp(logits)))
    for kw in ({}, {"batch_size": 4, "budget": 7}):
        got = first_token_logprobs(model, prompts, **kw)
        assert got.shape == (len(prompts), len(one[0])) and got.dtype == mx.float32
        np.testing.assert_allclose(np.array(got), np.stack(one), atol=2e-4)
    replies, lp = greedy_replies(model, tok, prompts, 4, first_logprobs=True)
    assert replies == greedy_replies(model, tok, prompts, 4)
    assert replies == greedy_replies(model, tok, prompts, 4, budget=7)  # prefilled 1 prompt x 7 tokens at a time
    np.testing.assert_allclose(np.array(lp), np.stack(one), atol=2e-4)


def test_abliterate_and_eval_share_one_kl():
    from mlx_fun.observe.evaluate import kl_divergence
    from mlx_fun.observe.refusal import mean_kl

    rng = np.random.default_rng(0)
    a, b = (mx.array(rng.normal(size=(5, 11)).astype(np.float32)) for _ in range(2))
    a, b = a - mx.logsumexp(a, axis=-1, keepdims=True), b - mx.logsumexp(b, axis=-1, keepdims=True)
    p = np.exp(np.array(a, np.float64))
    want = float(np.mean(np.sum(p * (np.array(a, np.float64) - np.array(b, np.float64)), axis=-1)))
    assert mean_kl(a, b) == pytest.approx(want, rel=1e-5)
    assert mean_kl(list(a), list(b)) == pytest.approx(float(kl_divergence(a, b).mean().item()), rel=1e-6)
    assert mean_kl(a, a) == 0.0


def test_dispatch_and_token_budget_like_every_model_command(make_model, tmp_path):
    harmful, benign = _prompts(tmp_path)
    path = make_model("qwen3_moe", bits=4)
    base = ["abliterate", "--model", path, "--harmful-dataset", harmful, "--benign-dataset", benign,
            "--no-refusal-filter", "--max-samples", "3", "--eval-samples", "2", "--rounds", "1", "--seed", "0"]
    expect_error(cli(*base, "--output", tmp_path / "bad", "--token-budget", "0"), "--token-budget")
    expect_error(cli(*base, "--output", tmp_path / "bad", "--dispatch-table", tmp_path / "none.json"),
                 "none.json")
    assert not (tmp_path / "bad").exists()
    norms = {}
    for name, extra in (("mlx-lm", ["--dispatch", "mlx-lm"]), ("auto", ["--token-budget", "5", "--dequant-cache",
                                                                        "64MiB"])):
        r = cli(*base, "--output", tmp_path / name, *extra)
        assert r.exit_code == 0, r.output
        meta = json.loads((tmp_path / name / "abliteration_metadata.json").read_text())
        norms[name] = meta["direction_norms"]
    for k, v in norms["mlx-lm"].items():  # the same directions whichever way the experts run, in any budget
        assert norms["auto"][k] == pytest.approx(v, rel=1e-3, abs=1e-5)


def test_replies_until_decided_stop_refusals_early_and_judge_every_reply_alike():
    """Abliteration asks of a reply only whether it refuses and how it opens: a refusal stops once its first two
    words are complete, an answer runs its full length, and both judgements equal the full replies'."""
    from pathlib import Path

    from mlx_fun.datasets.samples import load_samples
    from mlx_fun.observe.refusal import decided, greedy_replies, is_refusal, phrasing

    data = Path(__file__).resolve().parents[1] / "data"
    model, tok = load_model(data / "tiny-moe-chat")[:2]
    prompts = [p for name in ("harmful_test", "benign_test")
               for p in load_samples(data / "safety" / f"{name}.jsonl", tok, max_samples=8, seed=0,
                                     generation_prompt=True)]
    full = greedy_replies(model, tok, prompts, 16)
    short = greedy_replies(model, tok, prompts, 16, until_decided=True)
    assert [is_refusal(t) for t in short] == [is_refusal(t) for t in full]
    assert [phrasing(t) for t in short] == [phrasing(t) for t in full]
    refused = [i for i, t in enumerate(full) if is_refusal(t)]
    assert 4 <= len(refused) < len(full)  # both kinds are exercised
    assert all(len(tok.encode(short[i])) < len(tok.encode(full[i])) for i in refused)
    assert all(short[i] == full[i] for i in range(len(full)) if i not in refused)
    assert decided("I can't help with that") and not decided("I can't") and not decided("Use sorted(x) to")


def test_the_declared_choices_are_the_ones_the_code_takes():
    """abliterate's options name the extraction positions without importing MLX: the same as the capture's."""
    from mlx_fun.observe.residual import POSITIONS
    from mlx_fun.rewrite.abliterate_options import POSITIONS as DECLARED

    assert DECLARED == POSITIONS
