"""One run path: every command is a job behind a thin CLI module of the same name, one forward engine with a token
budget feeds collect and eval, and the runtime dispatch changes no statistic (and splits calls too large for the
backend)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

from mlx_fun.dispatch import experts as dsp
from mlx_fun.model import engine
from mlx_fun import jobs
from mlx_fun.adapters import get_adapter
from mlx_fun.cli import COMMANDS, main, module_name
from mlx_fun.observe.collect import collect
from mlx_fun.errors import UserError, cli_names, param
from mlx_fun.observe.evaluate import evaluate
from mlx_fun.model.io import load_model
from mlx_fun.settings import option_groups

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "mlx_fun"


@pytest.fixture(autouse=True)
def _no_user_table(tmp_path, monkeypatch):
    monkeypatch.setenv(dsp.TABLE_ENV, str(tmp_path / "no-user-table.json"))


# ------------------------------------------------------------------------------------- one name, three places


def test_every_command_is_one_cli_module_and_one_keyword_only_job():
    modules = {module_name(c) for c in COMMANDS}
    assert set(main.commands) == set(COMMANDS)
    assert {p.stem for p in (PKG / "cli").glob("*.py")} - {"__init__", "common", "options"} == modules
    assert {p.stem for p in (PKG / "jobs").glob("*.py")} - {"__init__", "common", "options"} == modules
    for name in COMMANDS:
        cli = importlib.import_module(f"mlx_fun.cli.{module_name(name)}")
        job = getattr(jobs, module_name(name))
        assert cli.command.name == name and callable(cli.show), name
        params = inspect.signature(job.run).parameters.values()
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params), name
        assert inspect.signature(job.run).return_annotation not in (inspect.Signature.empty, None, "None"), name
        # every CLI option is a parameter of the job, or a field of one of its option groups (RunSettings,
        # GenOptions, ...), under the same name (the CLI adds nothing of its own)
        groups = option_groups(job.run)
        job_params = {p.name for p in params} | {f.name for g in groups.values() for f in dataclasses.fields(g)}
        cli_params = {p.name for p in cli.command.params if p.name not in ("debug",)}
        assert cli_params <= job_params | {"json_output", "quiet", "no_progress"}, (name, cli_params - job_params)


def test_jobs_hold_what_they_are_about_and_take_how_to_run_as_one_settings_object():
    """No job's ``run`` has more than 15 parameters of its own (``revision=`` is the hub's); the dispatch / table / dequant cache / token budget / progress
    block appears in no job signature but as :class:`RunSettings` (``settings``), mlx-lm's generation options only
    as :class:`GenOptions` (``generation``); no job forwards its arguments through ``locals()``."""
    from mlx_fun.model.genopts import GenOptions
    from mlx_fun.settings import RunSettings

    run_fields = {f.name for f in dataclasses.fields(RunSettings)}
    gen_fields = {f.name for f in dataclasses.fields(GenOptions)}
    for name in COMMANDS:
        job = getattr(jobs, module_name(name))
        params = inspect.signature(job.run).parameters
        assert len(set(params) - {"revision"}) <= 15, (name, len(params), list(params))
        assert not (run_fields - {"progress"}) & set(params), (name, (run_fields - {"progress"}) & set(params))
        assert not gen_fields & set(params), (name, gen_fields & set(params))
        groups = option_groups(job.run)
        if "settings" in params:
            assert groups["settings"] is RunSettings and "progress" not in params, name
        if "generation" in params:
            assert groups["generation"] is GenOptions, name
    for path in (PKG / "jobs").glob("*.py"):
        assert "locals()" not in path.read_text(), path.name


def test_errors_name_the_keyword_in_python_and_the_flag_on_the_command_line(tmp_path, qwen_model):
    assert param("n_prune") == "n_prune="
    with cli_names():
        assert param("n_prune") == "--n-prune"
    (tmp_path / "s.npz").touch()  # an input that must exist is checked first (Opt(missing=...))
    with pytest.raises(UserError, match=r"^saliency= needs n_prune= "):
        jobs.prune.run(model=qwen_model, saliency=tmp_path / "s.npz", output=tmp_path / "out")
    result = CliRunner().invoke(main, ["prune", "--model", str(qwen_model), "--saliency", str(tmp_path / "s.npz"),
                                       "--output", str(tmp_path / "out")])
    assert result.exit_code == 2 and "--saliency" in result.output and "--n-prune" in result.output
    assert "n_prune=" not in result.output and not (tmp_path / "out").exists()


def test_job_and_cli_give_the_same_numbers(tmp_path, qwen_model):
    """The CLI only parses and prints: its .npz equals the job's, array for array."""
    data = ROOT / "data" / "calibration_sample.jsonl"
    args = dict(max_samples=6, max_tokens=64, seed=1, batch_size=3)
    got = jobs.collect.run(model=qwen_model, dataset=data, output=tmp_path / "job.npz", **args)
    result = CliRunner().invoke(main, ["collect", "--model", str(qwen_model), "--dataset", str(data), "--output",
                                       str(tmp_path / "cli.npz"), "--max-samples", "6", "--max-tokens", "64",
                                       "--seed", "1", "--batch-size", "3"])
    assert result.exit_code == 0, result.output
    a, b = np.load(tmp_path / "job.npz"), np.load(tmp_path / "cli.npz")
    assert sorted(a.files) == sorted(b.files)
    for key in a.files:
        assert np.array_equal(a[key], b[key]), key
    assert got.tokens == int(a["total_tokens"]) and got.dispatch == "auto"


# ------------------------------------------------------------------------------------------------ the engine


def test_batches_keep_every_forward_within_the_budget():
    rng = np.random.default_rng(0)
    samples = [list(range(n)) for n in rng.integers(1, 40, 23)]
    seen = []
    for tokens, lengths, rows in engine.batches(samples, 8, budget=30):
        assert tokens.shape[0] * min(tokens.shape[1], 30) <= 30
        assert tokens.shape[1] == lengths.max()
        for r, i in enumerate(rows):
            assert tokens[r, : lengths[r]].tolist() == samples[i]
        seen += rows.tolist()
    assert sorted(seen) == list(range(len(samples)))
    with pytest.raises(UserError, match="at least 1"):
        engine.token_budget(0)


def test_run_feeds_long_samples_in_chunks_with_the_right_targets():
    samples = [list(range(100, 137)), list(range(200, 205)), [7]]
    fed = {}

    class Probe:  # a stand-in model: records what it is fed, as an mlx-lm model with a KV cache would be
        layers = []

        def __call__(self, x, cache=None):
            return x

    def on_chunk(chunk, _out):
        for r, i in enumerate(chunk.rows):
            n = int(chunk.valid[r].sum())
            fed.setdefault(int(i), []).extend(zip(chunk.tokens[r, :n].tolist(), chunk.targets[r, :n].tolist()))

    n = engine.run(Probe(), samples, on_chunk, batch_size=2, budget=8, predict_next=True)
    assert n == 36 + 4  # the 1-token sample has nothing to predict
    for i in (0, 1):
        assert fed[i] == list(zip(samples[i][:-1], samples[i][1:]))
    assert 2 not in fed


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_a_small_token_budget_gives_the_same_statistics(make_model, model_type):
    """Batches split and long samples fed in 16-token chunks through the KV cache: counts exact, norms and router
    weights to float rounding, eval NLL to float rounding."""
    model, _, config = load_model(make_model(model_type))
    adapter = get_adapter(model, config)
    rng = np.random.default_rng(0)
    samples = [rng.integers(3, 200, int(n)).tolist() for n in (70, 45, 33, 12)]
    full = collect(model, adapter, samples, batch_size=4, token_budget=10_000)
    small = collect(model, adapter, samples, batch_size=4, token_budget=16)
    assert full.total_tokens == small.total_tokens == 160
    assert np.array_equal(full.freq, small.freq)
    for metric in ("weighted_freq", "reap", "ean"):
        np.testing.assert_allclose(small.scores(metric), full.scores(metric), rtol=2e-4, atol=1e-6)
    a = evaluate(model, {"x": samples}, batch_size=4, token_budget=10_000)["x"]
    b = evaluate(model, {"x": samples}, batch_size=4, token_budget=16)["x"]
    assert a["tokens"] == b["tokens"] == 156
    assert b["nll"] == pytest.approx(a["nll"], rel=1e-5)


# ------------------------------------------------------------------------------------------------ the dispatch


@pytest.mark.parametrize("plan", ["unsorted", "sorted", "blocked4", "dequant:sorted", "dequant:blocked8"])
def test_collect_through_the_dispatch_counts_exactly_what_mlx_lm_routes(make_model, plan):
    model, _, config = load_model(make_model("qwen3_moe", bits=4))
    adapter = get_adapter(model, config)
    rng = np.random.default_rng(1)
    samples = [rng.integers(3, 200, int(n)).tolist() for n in (40, 31, 9)]
    plain = collect(model, adapter, samples, batch_size=2)
    dsp.install(model, force=plan)
    try:
        assert all(dsp.is_dispatched(m) for m in dsp.expert_modules(model))
        ours = collect(model, adapter, samples, batch_size=2)
    finally:
        dsp.remove(model)
    assert np.array_equal(plain.freq, ours.freq)
    for metric in ("weighted_freq", "reap", "ean"):
        np.testing.assert_allclose(ours.scores(metric), plain.scores(metric), rtol=1e-4, atol=1e-6)


def test_calls_over_the_backend_row_limit_are_split(make_model):
    """CUDA cannot launch mlx-lm's quantized grouped matmul on more than 65,535 routed rows; the dispatch splits
    such calls. Here the limit is set to 24 rows on the CPU: same output, no call above it."""
    model, _, config = load_model(make_model("qwen3_moe", bits=4))
    adapter = get_adapter(model, config)
    x = mx.array(np.random.default_rng(2).integers(3, 200, (2, 40)))
    want = model(x)
    dsp.install(model)
    try:
        modules = dsp.expert_modules(model)
        for m in modules:
            dsp.state_of(m).max_rows = 24
        got = model(x)
        calls = [key for m in modules for key in dsp.state_of(m).calls]
    finally:
        dsp.remove(model)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    k = adapter.top_k
    assert calls and all(m * kk <= 24 and kk == k for m, kk in calls)


def test_budget_for_mlx_lms_call_stays_under_the_cuda_row_limit(monkeypatch):
    assert engine.budget_for(None, top_k=8, dispatched=False) == engine.DEFAULT_TOKEN_BUDGET  # CPU: no limit
    monkeypatch.setattr(dsp, "backend_name", lambda: "cuda")
    assert engine.budget_for(None, top_k=8, dispatched=False) == 65535 // 8
    assert engine.budget_for(None, top_k=8, dispatched=True) == engine.DEFAULT_TOKEN_BUDGET
    assert engine.budget_for(100, top_k=8, dispatched=False) == 100


def test_dense_quantized_linears_run_dequantized_from_the_cpu_cut_off():
    """A QuantizedLinear under the dispatch: bit-identical below MIN_ROWS (decode), dequantize-then-matmul from it
    on (same result to float rounding), never swapped on a backend without a cut-off, restored by remove()."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlx_fun.dispatch import dense as dispatch_dense

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.QuantizedLinear(64, 128, bias=True, group_size=32, bits=4)
            self.b = nn.Linear(128, 16)

    mx.random.seed(0)
    net = Net()
    rows = dispatch_dense.MIN_ROWS["cpu"]
    small, large = mx.random.normal((1, rows - 1, 64)), mx.random.normal((2, rows, 64))
    want_small, want_large = net.a(small), net.a(large)
    assert dispatch_dense.install(net, "cuda") == (0, 0) and type(net.a) is nn.QuantizedLinear
    assert dispatch_dense.install(net, "cpu") == (1, 0) and type(net.a) is dispatch_dense.DequantizedLinear
    assert type(net.b) is nn.Linear
    assert np.array_equal(np.array(net.a(small)), np.array(want_small))
    got = np.array(net.a(large))
    np.testing.assert_allclose(got, np.array(want_large), rtol=1e-5, atol=1e-5)
    keys = sorted(k for k, _ in tree_flatten(net.parameters()))
    assert keys == ["a.bias", "a.biases", "a.scales", "a.weight", "b.bias", "b.weight"]  # saved files unchanged
    assert dispatch_dense.remove(net) == 1 and type(net.a) is nn.QuantizedLinear


def test_an_option_group_of_the_wrong_type_is_one_line_naming_how_to_build_it(tmp_path, qwen_model):
    """A careless caller passing a dict (or anything) where a job takes an option group gets one line before
    anything is read or written, for every group of every job."""
    seen = 0
    for name in COMMANDS:
        job = getattr(jobs, module_name(name))
        for group, cls in option_groups(job.run).items():
            with pytest.raises(UserError, match=rf"^{group}= must be a {cls.__name__} \(from {cls.__module__} "
                                                rf"import {cls.__name__}; .*got dict\.$"):
                job.run(**{group: {"x": 1}})
            seen += 1
    assert seen >= 15 and not list(tmp_path.iterdir())
