"""`mlx-fun steer`: generation under report-driven steering equals generation under the same hook bias, the safety
modes follow SteerMoE (activate the HCDG experts of largest risk difference, or deactivate them), errors are one
line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mlx_fun import jobs
from mlx_fun.model import moe_hook
from mlx_fun.model.io import load_model
from mlx_fun.jobs.steer import SteerOptions
from mlx_fun.settings import RunSettings
from mlx_fun.experts.steering import SteeringError, from_reports

from .cli_helpers import expect_error
from .cli_helpers import run as cli
from .conftest import FAMILIES


@pytest.mark.parametrize("scheme", ["additive", "rank"])
def test_steer_generates_under_the_report_steering(make_model, tmp_path, scheme):
    from mlx_fun.adapters import get_adapter
    from mlx_fun.model.sampling import run_generation

    path = make_model("deepseek_v3")
    report = tmp_path / "domain_report.json"
    report.write_text(json.dumps({"domain_experts": {"1": [0]}, "general_experts": {"1": [1, 2], "2": [3]}}))
    got = jobs.steer.run(model=path, prompt="hello world",
                         steering=SteerOptions(domain_map=report, domain_mode="suppress", scheme=scheme),
                         max_tokens=8, compare=True, settings=RunSettings(dispatch="mlx-lm"))
    assert got.steering.deactivate == {1: [1, 2], 2: [3]} and not got.steering.activate
    assert got.steering.scheme == scheme
    model, tok, config = load_model(path)
    adapter = get_adapter(model, config)
    with moe_hook.hooked(adapter, [], got.steering.route_steers(adapter)):
        again = run_generation(model, tok, "hello world", max_tokens=8)
    plain = run_generation(model, tok, "hello world", max_tokens=8)
    assert got.generation.tokens == again.tokens and got.baseline.tokens == plain.tokens


def test_a_token_budget_keeps_the_steered_tokens(make_model, tmp_path):
    """``settings.token_budget`` bounds mlx-lm's prefill (its ``prefill_step_size``); greedy tokens stay the same."""
    path = make_model("deepseek_v3")
    report = tmp_path / "domain_report.json"
    report.write_text(json.dumps({"domain_experts": {"1": [0]}, "general_experts": {"1": [1, 2], "2": [3]}}))
    kw = dict(model=path, prompt="hello world, hello again world", max_tokens=6, compare=True,
              steering=SteerOptions(domain_map=report, domain_mode="suppress"))
    plain, budgeted = jobs.steer.run(**kw), jobs.steer.run(**kw, settings=RunSettings(token_budget=2))
    assert budgeted.generation.tokens == plain.generation.tokens
    assert budgeted.baseline.tokens == plain.baseline.tokens


def _safety_report(tmp_path, risk, ranked_by="risk_difference"):
    """A report over MoE layers [1, 3] and 8 experts whose HCDG holds every expert of positive risk difference."""
    risk = np.asarray(risk, dtype=float)
    hcdg = {str(layer): [int(e) for e in np.flatnonzero(risk[p] > 0)] for p, layer in enumerate([1, 3])}
    hrcg = {str(layer): [int(e) for e in np.flatnonzero(risk[p] < 0)] for p, layer in enumerate([1, 3])}
    report = tmp_path / "safety_report.json"
    report.write_text(json.dumps({"hcdg": hcdg, "hrcg": hrcg, "ranked_by": ranked_by,
                                  "safety_critical": {k: sorted(hcdg[k] + hrcg[k]) for k in hcdg},
                                  "scores": {"risk_difference": risk.tolist(), "composite": (-risk).tolist()}}))
    return report


def test_safe_activates_the_hcdg_experts_of_largest_risk_difference_over_all_layers(tmp_path):
    """SteerMoE's steer_moe: the N experts of positive risk difference with the largest one over all layers, then at
    most top_k per layer; unsafe deactivates every HCDG expert; HRCG experts are never touched."""
    risk = np.zeros((2, 8))
    risk[0, [2, 5]] = [0.30, 0.05]
    risk[1, [0, 1, 4, 6]] = [0.20, 0.50, 0.40, 0.10]
    risk[1, 3] = -0.9  # an HRCG expert, more active on benign prompts
    report = _safety_report(tmp_path, risk)
    steer = dict(moe_layer_indices=[1, 3], num_experts=8, safety_map=report)
    s = from_reports(top_k=4, safety_mode="safe", boost_experts=3, **steer)
    assert s.activate == {1: [2], 3: [1, 4]} and not s.deactivate and not s.warnings
    assert s.sources[0]["boost_experts"] == 3
    assert from_reports(top_k=4, safety_mode="safe", **steer).activate == {1: [2], 3: [0, 1, 4, 6]}  # default 5
    s = from_reports(top_k=2, safety_mode="safe", boost_experts=4, **steer)  # 3 of the top 4 in layer 3: capped
    assert s.activate == {1: [2], 3: [1, 4]} and "3 of the 4 experts to activate" in s.warnings[0]
    s = from_reports(top_k=2, safety_mode="unsafe", **steer)
    assert s.deactivate == {1: [2, 5], 3: [0, 1, 4, 6]} and not s.activate
    # a report of the composite ranking (older scans) ranks by its composite
    old = _safety_report(tmp_path, risk, ranked_by="composite")
    assert from_reports(moe_layer_indices=[1, 3], num_experts=8, top_k=4, safety_map=old, safety_mode="safe",
                        boost_experts=2).activate == {1: [5], 3: [6]}
    # scores that do not cover every expert of the group (a hand-edited report): layer and expert order
    data = json.loads(report.read_text())
    report.write_text(json.dumps(data | {"scores": {"risk_difference": [[1.0]]}}))
    assert from_reports(top_k=4, safety_mode="safe", boost_experts=3, **steer).activate == {1: [2, 5], 3: [0]}


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "3"])
def test_a_bad_boost_count_names_its_field(tmp_path, value):
    report = _safety_report(tmp_path, np.ones((2, 8)))
    with pytest.raises(SteeringError) as e:
        from_reports(moe_layer_indices=[1, 3], num_experts=8, top_k=2, safety_map=report, safety_mode="safe",
                     boost_experts=value)
    assert e.value.field == "boost_experts" and "positive integer" in str(e.value)


def test_a_report_whose_group_is_empty_says_so(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"hcdg": {}, "hrcg": {"1": [2]}}))
    s = from_reports(moe_layer_indices=[1, 3], num_experts=8, top_k=2, safety_map=tmp_path / "r.json",
                     safety_mode="safe")
    assert s.empty and s.warnings == [f'{tmp_path / "r.json"}: its "hcdg" map names no experts of this model\'s MoE '
                                      'layers, so safe steers nothing from it.']


def test_a_report_without_hcdg_cannot_steer(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"safety_critical": {"1": [0]}}))
    with pytest.raises(SteeringError, match='no "hcdg" map'):
        from_reports(moe_layer_indices=[1, 3], num_experts=8, top_k=2, safety_map=tmp_path / "r.json",
                     safety_mode="unsafe")


def test_steer_errors(make_model, tmp_path):
    path = make_model("qwen3_moe")
    expect_error(cli("steer", "--model", path, "--prompt", "x"), "nothing to steer")
    (tmp_path / "r.json").write_text(json.dumps({"hcdg": {"0": [99]}}))
    expect_error(cli("steer", "--model", path, "--prompt", "x", "--safety-map", tmp_path / "r.json", "--mode",
                     "unsafe"), "expert 99")
    expect_error(cli("steer", "--model", path, "--prompt", "x", "--safety-map", tmp_path / "r.json"), "--mode")
    expect_error(cli("steer", "--model", path, "--prompt", "x", "--safety-map", tmp_path / "none.json", "--mode",
                     "safe"), "--safety-map", "does not exist")
    (tmp_path / "d.json").write_text(json.dumps({"domain_experts": {"0": [0, 1, 2, 3, 4]}}))
    got = cli("steer", "--model", path, "--prompt", "x", "--domain-map", tmp_path / "d.json", "--domain-mode", "boost",
              "--scheme", "rank", "--max-tokens", "2")
    assert got.exit_code == 0 and "[steered (rank): 0 experts masked" in got.output


@pytest.mark.parametrize("family,bits", [(f, None) for f in FAMILIES] + [("qwen3_moe", 4), ("glm4_moe", 4)])
def test_a_masked_expert_is_never_selected(make_model, family, bits):
    """Every family, through its own routing: the two experts a layer uses most get no tokens once masked."""
    import mlx.core as mx

    from mlx_fun.adapters import get_adapter
    from mlx_fun.observe.collect import SaliencyTap, collect
    from mlx_fun.observe.saliency import SaliencyAccumulator

    model, _, config = load_model(make_model(family, bits=bits))
    adapter = get_adapter(model, config)
    rng = np.random.default_rng(0)
    samples = [rng.integers(3, 200, size=12).tolist() for _ in range(6)]
    base = collect(model, adapter, samples, norms=False)
    layers = adapter.moe_layers()
    hot = {str(layer): [int(e) for e in np.argsort(base.freq[p])[::-1][:2]] for p, layer in enumerate(layers)}
    s = from_reports(moe_layer_indices=layers, num_experts=adapter.num_experts, top_k=adapter.top_k, deactivate=hot)
    tap, acc = SaliencyTap(norms=False), SaliencyAccumulator.for_adapter(adapter)
    with moe_hook.hooked(adapter, [tap], s.route_steers(adapter)):
        for sample in samples:
            model(mx.array([sample]))
            tap.flush(acc)
    np.testing.assert_array_equal(acc.freq.sum(axis=1), adapter.top_k * sum(map(len, samples)))
    for p, layer in enumerate(layers):
        assert base.freq[p, hot[str(layer)]].sum() > 0 and acc.freq[p, hot[str(layer)]].sum() == 0, layer


def test_compare_prints_the_unsteered_reply_first(make_model, tmp_path):
    """Issue 29 row 23: `steer --compare` printed the unsteered reply after the steered one, though README and
    --help say first. Now: the unsteered line, then the steered text as it streams, then the steered summary."""
    path = make_model("deepseek_v3")
    report = tmp_path / "domain_report.json"
    report.write_text(json.dumps({"domain_experts": {"1": [0]}, "general_experts": {"1": [1, 2], "2": [3]}}))
    args = dict(model=path, prompt="hello world", domain_map=report, domain_mode="suppress", max_tokens=8)
    steering = SteerOptions(domain_map=report, domain_mode="suppress")
    want = jobs.steer.run(model=path, prompt="hello world", steering=steering, max_tokens=8, compare=True)
    assert want.generation.text and want.baseline.text
    got = cli("steer", *[a for k, v in args.items() for a in (f"--{k.replace('_', '-')}", v)], "--compare")
    assert got.exit_code == 0, got.output
    out, head = got.output, f"[unsteered: {want.baseline.text!r}]\n"
    assert head in out, out
    before, after = out[:out.index(head)], out[out.index(head) + len(head):]
    assert want.generation.text not in before and "[steered (" not in before, out  # nothing steered before it
    assert after.startswith(want.generation.text), out  # then the steered text, streamed
    assert after[len(want.generation.text):].lstrip("\n").startswith("[steered (rank): 3 experts masked"), out


def test_help_examples_keep_their_line_breaks():
    """Issue 29 row 23: a lone `\\` at a line's end in cli/steer.py's docstring joined its second example into one
    line of --help. Each example line ends in ` \\` or ends the command, and holds no run of spaces."""
    text = cli("steer", "--help").output
    example = text[text.index("Example"):text.index("Options:")]
    lines = [ln.strip() for ln in example.splitlines()[1:] if ln.strip()]
    assert sum(ln.startswith("mlx-fun steer ") for ln in lines) == 2 and len(lines) == 4, example
    assert all("  " not in ln for ln in lines), example
    assert [ln.endswith(" \\") for ln in lines] == [True, False, True, False], example


@pytest.mark.parametrize("field, value, what", [("mask_value", -1e-300, "rounds to 0"),
                                                ("boost_value", 1e-300, "rounds to 0"),
                                                ("mask_value", -1e300, "is infinite")])
def test_a_steering_value_float32_cannot_hold_is_refused(field, value, what):
    """Issue 41 row 12: `mask_value -1e-300` / `boost_value 1e-300` became 0 in float32 and steered nothing (200)."""
    from mlx_fun.experts.steering import SteeringError, from_reports

    import re

    with pytest.raises(SteeringError, match=rf"^{field} {re.escape(f'{value:g}')} {what} in float32, .*; pass a "):
        from_reports(moe_layer_indices=[0, 1], num_experts=8, top_k=2, deactivate={"0": [1]}, **{field: value})
