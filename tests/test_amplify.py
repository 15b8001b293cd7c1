"""`mlx-fun amplify`: the boost lands in the family's own router bias, a run that would change nothing is refused, the result opens with
plain mlx_lm.load and routes the domain to its experts more often; bias-less families are refused in one line."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load

from mlx_fun import jobs
from mlx_fun.adapters import get_adapter
from mlx_fun.errors import UserError
from mlx_fun.model.io import load_model
from mlx_fun.rewrite.amplify import target

from .cli_helpers import expect_error
from .cli_helpers import run as cli
from .conftest import FAMILIES


def _report(path, adapter, experts: dict[int, list[int]], score: float = 2.0):
    comp = np.zeros((len(adapter.moe_layers()), adapter.num_experts))
    for pos, es in experts.items():
        comp[pos, es] = score
    path.write_text(json.dumps({"domain_name": "test", "scores": {"composite": comp.tolist()},
                                "domain_experts": {str(adapter.moe_layers()[p]): es for p, es in experts.items()}}))
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_amplify_every_family_or_refuse(make_model, tmp_path, family):
    path = make_model(family)
    model, tok, config = load_model(path)
    adapter = get_adapter(model, config)
    report = _report(tmp_path / "d.json", adapter, {0: [0, 1]})
    found = target(adapter, adapter.blocks()[0])
    if found is None:
        expect_error(cli("amplify", "--model", path, "--domain-map", report, "--output", tmp_path / "out"),
                     "no router bias", "steer")
        assert not (tmp_path / "out").exists()
        return
    got = jobs.amplify.run(model=path, domain_map=report, output=tmp_path / "out", scale=0.5)
    assert got.boosted == {str(adapter.moe_layers()[0]): {"0": 1.0, "1": 1.0}}
    amplified, _ = mlx_lm_load(str(tmp_path / "out"))  # plain mlx-lm, strict
    a2 = get_adapter(amplified, json.loads((tmp_path / "out" / "config.json").read_text()))
    name = found[0]
    before = dict(tree_flatten(adapter.blocks()[0].parameters()))[name]
    after = dict(tree_flatten(a2.blocks()[0].parameters()))[name]
    delta = np.array((after.astype(mx.float32) - before.astype(mx.float32)))
    np.testing.assert_allclose(delta[:2], 1.0, atol=1e-2)
    assert np.all(delta[2:] == 0)
    meta = json.loads((tmp_path / "out" / "amplification_metadata.json").read_text())
    assert meta["target"] == found[1] and meta["scale"] == 0.5 and meta["domain_name"] == "test"


def test_boost_raises_domain_routing(make_model, tmp_path):
    from mlx_fun.observe.collect import collect

    path = make_model("deepseek_v3")
    model, tok, config = load_model(path)
    adapter = get_adapter(model, config)
    rng = np.random.default_rng(0)
    samples = [rng.integers(3, 200, size=16).tolist() for _ in range(8)]
    base = collect(model, adapter, samples, norms=False)
    cold = {p: [int(np.argmin(base.freq[p]))] for p in range(len(adapter.moe_layers()))}
    report = _report(tmp_path / "d.json", adapter, cold, score=3.0)
    jobs.amplify.run(model=path, domain_map=report, output=tmp_path / "amp", scale=1.0)
    m1, _, c1 = load_model(tmp_path / "amp")
    after = collect(m1, get_adapter(m1, c1), samples, norms=False)
    for p, (e,) in cold.items():
        assert after.freq[p, e] > base.freq[p, e], (p, e)


def test_amplify_errors(make_model, tmp_path):
    path = make_model("deepseek_v3")
    (tmp_path / "bare.json").write_text(json.dumps({"domain_experts": {"1": [0]}}))
    expect_error(cli("amplify", "--model", path, "--domain-map", tmp_path / "bare.json", "--output",
                     tmp_path / "o"), "scores.composite", "domain-scan")
    expect_error(cli("amplify", "--model", path, "--domain-map", tmp_path / "none.json", "--output", tmp_path / "o"),
                 "--domain-map", "does not exist")
    r = cli("amplify", "--model", path, "--domain-map", tmp_path / "bare.json", "--output", tmp_path / "o",
            "--scale", -1)
    assert r.exit_code == 2 and "--scale" in r.output
    assert not (tmp_path / "o").exists()


def test_a_scale_whose_bias_is_not_finite_is_refused_naming_the_largest_that_is(make_model, tmp_path):
    """Issue 29 row 11: `--scale 1e300` wrote inf into e_score_correction_bias. Any scale (or --threshold) whose
    boosted bias is not finite in the bias's dtype is refused before anything is written; the message names
    --scale and the largest finite scale, and that scale works."""
    import re

    from .test_nothing_lost import hidden, tree

    path = make_model("deepseek_v3")
    model, tok, config = load_model(path)
    adapter = get_adapter(model, config)
    report = _report(tmp_path / "d.json", adapter, {0: [0, 1]})
    before, out = tree(path), tmp_path / "out"
    base = ["amplify", "--model", path, "--domain-map", report, "--output", out]
    for extra in (["--scale", "1e300"], ["--scale", "1e39"]):
        got = cli(*base, *extra)
        expect_error(got, "--scale", "infinite in float32", "the largest finite scale for this model")
        assert not out.exists() and hidden(tmp_path) == [] and tree(path) == before
    largest = float(re.search(r"pass --scale (\S+) or less", got.output).group(1))
    assert 1.6e38 < largest < 1.71e38  # float32's 3.4e38 over the composite score 2
    assert cli(*base, "--scale", largest).exit_code == 0
    written, _, written_config = load_model(out)
    name = target(adapter, adapter.blocks()[0])[0]
    bias = dict(tree_flatten(get_adapter(written, written_config).blocks()[0].parameters()))[name]
    assert mx.isfinite(bias).all().item() and bias.max().item() > 3e38
    with pytest.raises(UserError, match=r"^scale= 1e\+300 would make .* pass scale= 1.7e\+38 or less"):
        jobs.amplify.run(model=path, domain_map=report, output=tmp_path / "py", scale=1e300)
    # the other numeric inputs: a threshold so low that composite − threshold overflows, a non-finite composite
    layer, n = str(adapter.moe_layers()[0]), adapter.num_experts
    comp = np.zeros((len(adapter.moe_layers()), n))
    comp[0, :2] = 1e308
    (tmp_path / "huge.json").write_text(json.dumps({"scores": {"composite": comp.tolist()},
                                                    "domain_experts": {layer: [0, 1]}}))
    expect_error(cli("amplify", "--model", path, "--domain-map", tmp_path / "huge.json", "--output", tmp_path / "o2",
                     "--threshold", "-1e308"), "--threshold -1e+308", "overflows")
    comp[0, :2] = np.nan
    (tmp_path / "nan.json").write_text(json.dumps({"scores": {"composite": comp.tolist()},
                                                   "domain_experts": {layer: [0]}}))
    expect_error(cli("amplify", "--model", path, "--domain-map", tmp_path / "nan.json", "--output", tmp_path / "o2"),
                 "--domain-map", "non-finite")
    assert not (tmp_path / "py").exists() and not (tmp_path / "o2").exists()
    assert hidden(tmp_path) == [] and tree(path) == before


def test_a_threshold_far_below_the_scores_is_blamed_not_the_scale(make_model, tmp_path):
    """Issue 41 row 14: `--threshold -1e300` said "--scale 1 would make ... infinite" (the scale was fine)."""
    path = make_model("deepseek_v3")
    model, tok, config = load_model(path)
    report = _report(tmp_path / "d.json", get_adapter(model, config), {0: [0, 1]})
    got = cli("amplify", "--model", path, "--domain-map", report, "--output", tmp_path / "out", "--threshold", "-1e300")
    expect_error(got, "--threshold -1e+300 is so far below the composite scores", "[2, 2]",
                 "pass a --threshold near the scores")
    assert "--scale" not in got.output.replace("at --scale 1", "") and not (tmp_path / "out").exists()


def _float16_bias(path, tmp_path):
    """A copy of model ``path`` whose router biases are stored in float16."""
    import shutil

    out = tmp_path / "f16"
    shutil.copytree(path, out)
    for f in out.glob("*.safetensors"):
        weights = mx.load(str(f))
        weights = {k: v.astype(mx.float16) if k.endswith("e_score_correction_bias") else v for k, v in weights.items()}
        mx.save_safetensors(str(f), weights, metadata={"format": "mlx"})
    return out


def test_a_run_that_would_change_nothing_is_refused(make_model, tmp_path):
    """Issue 41 row 12: `--scale 0`, a threshold no domain expert reaches and a scale that rounds away in the bias's
    dtype (1e-10 on a float16 bias) wrote an unchanged copy labelled amplified (exit 0)."""
    from .test_nothing_lost import hidden, tree

    path = make_model("deepseek_v3")
    model, tok, config = load_model(path)
    adapter = get_adapter(model, config)
    report = _report(tmp_path / "d.json", adapter, {0: [0, 1]})  # composite 2 on the domain experts
    out = tmp_path / "out"
    base = ["amplify", "--model", path, "--domain-map", report, "--output", out]
    expect_error(cli(*base, "--scale", "0"), "--scale", "0 < x")
    with pytest.raises(UserError, match=r"^scale=: 0.0 is not in the range 0.0 < x"):  # the option's own range
        jobs.amplify.run(model=path, domain_map=report, output=out, scale=0.0)
    expect_error(cli(*base, "--threshold", "2"), "no domain expert", "above --threshold 2", "[2, 2]",
                 "pass a lower --threshold")
    half = _float16_bias(path, tmp_path)
    before = tree(half)
    expect_error(cli("amplify", "--model", half, "--domain-map", report, "--output", out, "--scale", "1e-10"),
                 "--scale 1e-10 changes no", "in float16", "rounds away", "pass a larger --scale")
    assert not out.exists() and hidden(tmp_path) == [] and tree(half) == before
    assert cli("amplify", "--model", half, "--domain-map", report, "--output", out, "--scale", "1e-3").exit_code == 0
