"""The counting machinery under `serve`, without HTTP: padded batched prompts counted exactly (per expert, against
offline collect), steering through each family's own routing, mlx-lm's server options all provided."""

from __future__ import annotations

import json

import re
from pathlib import Path

import numpy as np
import pytest

from mlx_fun import jobs
from mlx_fun.model.io import bundled_model_dir, read_config
from mlx_fun.serve.options import ServerOptions
from mlx_fun.experts.steering import SteeringError, from_reports

MODEL = bundled_model_dir()


def test_batched_padded_prompts_count_like_offline_collect():
    """mlx-lm's BatchGenerator right-pads prompts of unequal length and prefills them in chunks; the counts equal
    an offline collect of the same token sequences, expert by expert."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    from mlx_fun.adapters import get_adapter
    from mlx_fun.observe.collect import collect
    from mlx_fun.serve.counting import TrafficCounter, attach, detach, install_padding_probe, remove_padding_probe

    model, tok = load(str(MODEL))
    adapter = get_adapter(model, read_config(MODEL))
    counter = TrafficCounter(adapter, norms=True)
    attach(model, counter)
    install_padding_probe()
    try:
        prompts = [tok.encode("import os\nprint(os.getcwd())\n" * k) for k in (1, 3, 7, 2, 5)]
        gen = BatchGenerator(model, prefill_batch_size=8, completion_batch_size=8, prefill_step_size=16)
        uids = gen.insert(prompts, max_tokens=[1] * len(prompts))
        last = {}
        while True:
            p, g = gen.next()
            if not p and not g:
                break
            last.update({r.uid: r.token for r in g})
        counter.flush()
    finally:
        remove_padding_probe()
        detach(model, counter)
    acc, totals = counter.snapshot()
    seqs = [p + [last[u]] for p, u in zip(prompts, uids)]
    ref = collect(model, adapter, seqs, batch_size=1)
    assert totals["padding_skipped"] > 0  # padding really happened ...
    assert totals["token_count"] == ref.total_tokens == sum(map(len, seqs))  # ... and was not counted
    np.testing.assert_array_equal(acc.freq, ref.freq)
    np.testing.assert_allclose(acc.weighted_freq_sum, ref.weighted_freq_sum, rtol=1e-5)
    np.testing.assert_allclose(acc.reap_sum, ref.reap_sum, rtol=1e-4)


def test_server_args_cover_what_mlx_lm_reads():
    """Every ``cli_args.<name>`` mlx-lm's server code reads exists in the namespace we hand it."""
    import mlx_lm.server

    from mlx_fun.serve.generator import server_args

    names = set(re.findall(r"cli_args\.(\w+)", Path(mlx_lm.server.__file__).read_text()))
    args = server_args(model="m", server=ServerOptions(max_tokens=1), prompt_concurrency=1)
    assert names and not [n for n in names if not hasattr(args, n)]


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "mixtral", "glm4_moe"])
def test_steering_off_through_each_routing(make_model, family):
    """Group-limited sigmoid + correction bias (deepseek_v3, glm4_moe), router bias (gpt_oss), softmax after top-k
    (mixtral): a deactivated expert is never chosen while live traffic flows."""
    from mlx_fun.testing.loadtest import run_load

    server = jobs.serve.start(model=make_model(family), server=ServerOptions(port=0))
    try:
        counter = server.counter
        a = counter.adapter
        run_load(server.url, clients=1, requests=2, max_tokens=6)
        acc, _ = counter.snapshot()
        layer_pos = 0
        hot = [int(e) for e in np.argsort(acc.freq[layer_pos])[::-1][:2]]
        layer = a.moe_layers()[layer_pos]
        s = from_reports(moe_layer_indices=a.moe_layers(), num_experts=a.num_experts, top_k=a.top_k,
                         deactivate={str(layer): hot})
        server.app.generator.post_steering(s)
        assert counter.sync(server.app.generation_alive)
        counter.reset()
        result = run_load(server.url, clients=2, requests=2, max_tokens=6)
        acc, totals = counter.snapshot()
        assert result.errors == 0 and result.counts_exact
        assert totals["token_count"] > 0 and acc.freq[layer_pos, hot].sum() == 0
        np.testing.assert_array_equal(acc.freq.sum(axis=1), a.top_k * totals["token_count"])
    finally:
        server.stop()


def test_steering_checks_name_the_field(tmp_path):
    kw = dict(moe_layer_indices=[1, 2, 3], num_experts=8, top_k=2)
    with pytest.raises(SteeringError) as e:
        from_reports(**kw, deactivate={"0": [1]})
    assert e.value.field == "deactivate.0" and "not an MoE layer" in str(e.value) and "1..3" in str(e.value)
    with pytest.raises(SteeringError) as e:
        from_reports(**kw, deactivate={"1": list(range(7))})
    assert e.value.field == "deactivate.1"
    with pytest.raises(SteeringError) as e:
        from_reports(**kw, safety_map=tmp_path / "nope.json", safety_mode="safe")
    assert e.value.field == "safety_map"
    with pytest.raises(SteeringError) as e:
        from_reports(**kw, domain_mode="boost")
    assert e.value.field == "domain_mode"
    s = from_reports(**kw, activate={"2": [0, 1, 2]}, boost_value=50, scheme="additive")
    assert s.warnings and s.activate == {2: [0, 1, 2]} and s.boost_value == 50 and s.scheme == "additive"


def test_steering_that_changes_nothing_is_refused(tmp_path):
    """Issue 29 row 18c: activating every expert of a layer (or every one not deactivated) moves no token to
    another expert; it was accepted (additive) and did nothing. Now a SteeringError naming activate.<layer> (a
    400 over REST, see test_serve.py), and through the same check one line, exit 2, from `mlx-fun steer`."""
    from .cli_helpers import expect_error
    from .cli_helpers import run as cli

    kw = dict(moe_layer_indices=[1, 2, 3], num_experts=8, top_k=2)
    for activate, deactivate in (({"2": list(range(8))}, None), ({"3": [0, 1, 2, 3, 4, 5]}, {"3": [6, 7]})):
        with pytest.raises(SteeringError) as e:
            from_reports(**kw, activate=activate, deactivate=deactivate)
        assert e.value.field == f"activate.{next(iter(activate))}" and "changes nothing" in str(e.value)
    assert from_reports(**kw, activate={"2": list(range(7))}, scheme="additive").activate == {2: list(range(7))}
    # the CLI: activate a layer's top_k HCDG experts and suppress all its other (general) ones
    config = json.loads((MODEL / "config.json").read_text())
    k, n = config["num_experts_per_tok"], config["num_experts"]
    (tmp_path / "safety.json").write_text('{"hcdg": {"1": %s}}' % list(range(k)))
    (tmp_path / "domain.json").write_text('{"general_experts": {"1": %s}}' % list(range(k, n)))
    expect_error(cli("steer", "--model", MODEL, "--prompt", "x", "--safety-map", tmp_path / "safety.json",
                     "--mode", "safe", "--boost-experts", k, "--domain-map", tmp_path / "domain.json",
                     "--domain-mode", "suppress"),
                 "layer 1", "changes nothing")
