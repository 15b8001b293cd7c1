"""`mlx-fun prune` end to end: saliency and expert-list modes, protection, summary, metadata, error paths."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx_lm
import numpy as np

from mlx_fun.observe.saliency import SaliencyAccumulator

from .test_cli import SAMPLE
from .cli_helpers import expect_error as _error, run  # noqa: E402




def _saliency(tmp_path, model):
    out = tmp_path / "s.npz"
    assert run("collect", "--model", model, "--dataset", SAMPLE, "--output", out, "--max-tokens", 48).exit_code == 0
    return out


def test_prune_cli_bottom_and_metadata(tmp_path, make_model):
    model = make_model("qwen3_moe", bits=4)
    sal = _saliency(tmp_path, model)
    out = tmp_path / "pruned"
    result = run("prune", "--model", model, "--saliency", sal, "--n-prune", 3, "--output", out)
    assert result.exit_code == 0, result.output
    assert "8 → 5" in result.output and "size on disk" in result.output
    meta = json.loads((out / "reap_metadata.json").read_text())
    scores = SaliencyAccumulator.load(sal).scores("reap")
    for pos, layer in enumerate([0, 1]):
        kept = meta["keep_map"][str(layer)]
        assert kept == sorted(np.argsort(-scores[pos], kind="stable")[:5].tolist())
    assert meta["original_num_experts"] == 8 and meta["pruned_num_experts"] == 5 and meta["metric"] == "reap"
    reloaded, _ = mlx_lm.load(str(out))
    assert reloaded(mx.array([[1, 2, 3]])).shape == (1, 3, 512)
    assert json.loads((out / "config.json").read_text())["num_experts"] == 5


def test_prune_cli_expert_list_and_protect(tmp_path, make_model):
    model = make_model("mixtral")
    sal = _saliency(tmp_path, model)
    lst = tmp_path / "list.json"
    lst.write_text(json.dumps({"format": "mlx-fun-expert-list", "version": 1,
                               "layers": {"0": {"remove": [1, 2]}, "1": {"keep": [0, 1, 2, 3, 4, 5]}}}))
    result = run("prune", "--model", model, "--expert-list", lst, "--output", tmp_path / "a")
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "a" / "reap_metadata.json").read_text())
    assert meta["keep_map"] == {"0": [0, 3, 4, 5, 6, 7], "1": [0, 1, 2, 3, 4, 5]}

    report = tmp_path / "safety.json"
    report.write_text(json.dumps({"safety_critical": {"0": [0, 1, 2, 3, 4, 5], "1": []}}))
    result = run("prune", "--model", model, "--saliency", sal, "--n-prune", 2, "--output", tmp_path / "b",
                 "--safety-map", report, "--safety-mode", "protect")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "b" / "reap_metadata.json").read_text())["keep_map"]["0"] == [0, 1, 2, 3, 4, 5]


def test_prune_cli_errors(tmp_path, make_model):
    model = make_model("qwen3_moe")
    sal = _saliency(tmp_path, model)
    out = tmp_path / "out"
    _error(run("prune", "--model", model, "--saliency", sal, "--n-prune", 7, "--output", out), "top_k is 2")
    _error(run("prune", "--model", model, "--output", out, "--n-prune", 1), "exactly one of --saliency")
    _error(run("prune", "--model", model, "--saliency", sal, "--output", out), "needs --n-prune")
    _error(run("prune", "--model", model, "--saliency", tmp_path / "x.npz", "--n-prune", 1, "--output", out),
           "--saliency", "does not exist")
    _error(run("prune", "--model", model, "--saliency", sal, "--n-prune", 1, "--output", model), "is the input given to --model")
    _error(run("prune", "--model", model, "--saliency", sal, "--n-prune", 1, "--output", out,
               "--ignore-experts", "1"), "--model-wide")
    other = make_model("qwen3_moe", num_experts=16)
    _error(run("prune", "--model", other, "--saliency", sal, "--n-prune", 1, "--output", out), "does not match")
    assert not out.exists()
    result = run("prune", "--model", model, "--saliency", sal, "--n-prune", 6, "--output", out)
    assert result.exit_code == 0 and "Warning" in result.output


def test_a_prune_or_merge_that_removes_nothing_is_refused(tmp_path, make_model):
    """Issue 41 row 12: `prune --n-prune 0` and `merge --n-prune 0` (and an expert list that removes nothing) wrote
    an unchanged copy labelled pruned / merged, exit 0. Each is refused in one line before anything is written."""
    from pathlib import Path

    import pytest

    from mlx_fun import jobs
    from mlx_fun.errors import UserError
    from mlx_fun.experts.selection import Selection

    model = make_model("qwen3_moe", bits=4)
    sal = _saliency(tmp_path, model)
    out = tmp_path / "same"
    _error(run("prune", "--model", model, "--saliency", sal, "--n-prune", 0, "--output", out),
           "--n-prune", "0 is not in the range x>=1")
    _error(run("merge", "--model", model, "--saliency", sal, "--n-prune", 0, "--dataset", SAMPLE, "--output", out),
           "--n-prune", "0 is not in the range x>=1")
    for bad in (0, -3):  # one rule for prune and merge, where the selection is built (Selection is a Group)
        with pytest.raises(UserError, match=rf"^n_prune= must be a whole number >= 1, got {bad}\.$"):
            Selection(n_prune=bad)
        with pytest.raises(UserError, match=rf"^n_prune= must be a whole number >= 1, got {bad}\.$"):
            jobs.prune.run(model=model, saliency=sal, n_prune=bad, output=out)  # a field given by name: the same
    with pytest.raises(UserError, match=r"^seed= must be a whole number between 0 and \d+, got -1\.$"):  # Calibration
        jobs.merge.run(model=model, saliency=sal, selection=Selection(n_prune=1), dataset=SAMPLE, output=out, seed=-1)
    layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
    nothing = tmp_path / "nothing.json"
    nothing.write_text(json.dumps({"format": "mlx-fun-expert-list", "version": 1,
                                   "layers": {str(i): {"remove": []} for i in range(layers)}}))
    _error(run("prune", "--model", model, "--expert-list", nothing, "--output", out),
           f"--expert-list {nothing} removes no expert from any layer", "unchanged copy labelled pruned")
    _error(run("merge", "--model", model, "--expert-list", nothing, "--dataset", SAMPLE, "--output", out),
           f"--expert-list {nothing} keeps every expert of every layer", "unchanged copy labelled merged")
    assert not out.exists()
