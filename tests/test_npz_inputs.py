"""Every reader of saliency ``.npz`` files (prune, merge, quantize, stats-*, the UI's analysis) goes through the one
validator in ``SaliencyAccumulator.load`` and refuses a metric that ranks nothing (issue 29, rows 10, 12, 22).

Files are built with numpy in tmp_path; every refusal is checked for exit 2, its one ``Error:`` line, no output and
unchanged inputs."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from mlx_fun.errors import UserError
from mlx_fun.observe.saliency import SaliencyAccumulator

from .cli_helpers import expect_error, run
from .test_cli import SAMPLE


def arrays(moe=(0, 1), E=8, top_k=2, model_type="qwen3_moe", seed=0) -> dict:
    """The arrays `mlx-fun collect` writes, with distinct positive statistics in every layer."""
    rng = np.random.default_rng(seed)
    L = len(moe)
    freq = rng.integers(1, 50, (L, E)).astype(np.float64)
    w = rng.uniform(0.1, 0.9, (L, E))
    norms = rng.uniform(1, 5, (L, E))
    return {"freq": freq, "weighted_freq_sum": freq * w, "reap_sum": freq * w * norms, "ean_sum": freq * norms,
            "reap_count": freq.copy(), "max_activation_norm": norms * 2, "model_type": np.array(model_type),
            "num_layers": np.array(L), "num_experts": np.array(E), "moe_layer_indices": np.array(moe),
            "top_k": np.array(top_k), "total_tokens": np.array(100), "format_version": np.array(1)}


def save(path, data: dict):
    np.savez(path, **data)
    return path


def digest(*paths) -> list[str]:
    return [hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths]


def refused(result, *, needles=(), absent=()):
    """Exit 2 with one Error line holding every needle; none of ``absent`` exist afterwards."""
    expect_error(result, *needles)
    for p in absent:
        assert not p.exists(), p


# ------------------------------------------------------------------------------- row 10: a metric that ranks nothing
def test_prune_refuses_a_file_without_reap_sum(tmp_path, qwen_model):
    data = arrays()
    del data["reap_sum"]
    sal = save(tmp_path / "noreap.npz", data)
    before = digest(sal)
    out = tmp_path / "out"
    refused(run("prune", "--model", qwen_model, "--saliency", sal, "--n-prune", 2, "--output", out),
            needles=(f"--saliency {sal} cannot rank experts by --metric reap", "every expert of layer 0 scores 0",
                     "no 'reap_sum' array", "this file can rank by ean or freq or weighted_freq", "--metric ean"),
            absent=(out,))
    assert digest(sal) == before
    ok = run("prune", "--model", qwen_model, "--saliency", sal, "--n-prune", 2, "--output", out, "--metric", "freq")
    assert ok.exit_code == 0, ok.output  # the metric the message offers works


def test_prune_refuses_a_file_purged_of_everything(tmp_path, qwen_model):
    sal = save(tmp_path / "s.npz", arrays())
    purged = tmp_path / "purged.npz"
    # stats-purge refuses to write such a file (issue 41 row 12); an older one, or the library's, still reaches prune
    from mlx_fun.observe import stats

    done, report = stats.purge(SaliencyAccumulator.load(sal), min_freq=1e9)
    assert report["purged"] == report["total"] == 16
    done.save(purged)
    before = digest(sal, purged)
    out = tmp_path / "out"
    for extra in ((), ("--model-wide",), ("--metric", "freq")):
        refused(run("prune", "--model", qwen_model, "--saliency", purged, "--n-prune", 2, "--output", out, *extra),
                needles=("cannot rank experts by --metric", "no metric of this file can: re-run `mlx-fun collect`"),
                absent=(out,))
    assert digest(sal, purged) == before


def test_prune_names_the_tied_layer_and_the_no_norms_case(tmp_path, qwen_model):
    data = arrays(moe=(0, 1))
    data["freq"][1] = 7.0  # layer 1: every expert routed equally often
    sal = save(tmp_path / "flat.npz", data)
    out = tmp_path / "out"
    refused(run("prune", "--model", qwen_model, "--saliency", sal, "--n-prune", 2, "--output", out, "--metric",
                "freq"), needles=("every expert of layer 1 scores 7", "--metric reap"), absent=(out,))
    data = arrays()
    for key in ("reap_sum", "ean_sum", "reap_count", "max_activation_norm"):
        data[key][...] = 0.0  # collected frequency-only
    sal = save(tmp_path / "freqonly.npz", data)
    refused(run("prune", "--model", qwen_model, "--saliency", sal, "--n-prune", 2, "--output", out),
            needles=("no output norms", "can rank by freq or weighted_freq"), absent=(out,))


def test_merge_refuses_a_metric_that_ranks_nothing(tmp_path, qwen_model):
    data = arrays()
    data["ean_sum"][...] = 0.0
    sal = save(tmp_path / "s.npz", data)
    before = digest(sal)
    out = tmp_path / "m"
    refused(run("merge", "--model", qwen_model, "--saliency-source", "file", "--saliency", sal, "--n-prune", 2,
                "--dataset", SAMPLE,
                "--output", out, "--metric", "ean"),
            needles=(f"--saliency {sal} cannot rank experts by --metric ean", "can rank by reap"), absent=(out,))
    assert digest(sal) == before


def test_quantize_cold_layers_refuse_equal_layer_totals(tmp_path, qwen_model):
    data = arrays()
    data["freq"][...] = [[1, 2, 3, 4, 5, 6, 7, 8], [8, 7, 6, 5, 4, 3, 2, 1]]  # every layer routes 36 pairs
    sal = save(tmp_path / "s.npz", data)
    before = digest(sal)
    out = tmp_path / "q"
    base = ("quantize", "--model", qwen_model, "--saliency", sal, "--cold-layers", 1, "--cold-bits", 2, "--output", out)
    refused(run(*base, "--metric", "freq"),
            needles=("cannot rank layers by --metric freq", "every MoE layer's experts sum to 36", "--metric reap"),
            absent=(out,))
    assert digest(sal) == before


# ------------------------------------------------------------------------------- row 12: NaN / negative counts
@pytest.mark.parametrize("key,value,rule", [("freq", np.nan, "finite and not negative"),
                                            ("reap_count", -1.0, "finite and not negative"),
                                            ("reap_sum", np.inf, "finite")])
def test_every_stats_command_refuses_bad_numbers(tmp_path, key, value, rule):
    good = save(tmp_path / "good.npz", arrays(seed=1))
    data = arrays(seed=2)
    data[key][1, 3] = value
    bad = save(tmp_path / "bad.npz", data)
    before = digest(good, bad)
    out = tmp_path / "out.npz"
    needles = (f"{bad}: '{key}' is {value} at MoE layer position 1, expert 3", f"must be {rule}")
    refused(run("stats-merge", "--files", good, "--files", bad, "--output", out),
            needles=("--files", *needles), absent=(out,))
    refused(run("stats-diff", "--file1", good, "--file2", bad, "--output", out),
            needles=("--file2", *needles), absent=(out,))
    refused(run("stats-purge", "--input", bad, "--output", out, "--min-freq", 1),
            needles=("--input", *needles), absent=(out,))
    assert digest(good, bad) == before


def test_prune_and_quantize_refuse_negative_freq(tmp_path, qwen_model):
    data = arrays()
    data["freq"][0, 0] = -5.0
    sal = save(tmp_path / "neg.npz", data)
    before = digest(sal)
    out = tmp_path / "out"
    needles = (f"--saliency {sal}: 'freq' is -5.0 at MoE layer position 0, expert 0", "not negative")
    refused(run("quantize", "--model", qwen_model, "--saliency", sal, "--cold-layers", 1, "--cold-bits", 2,
                "--output", out), needles=needles, absent=(out,))
    refused(run("prune", "--model", qwen_model, "--saliency", sal, "--n-prune", 2, "--output", out, "--metric",
                "freq"), needles=needles, absent=(out,))
    assert digest(sal) == before
    data["freq"][0, 0] = np.nan
    nan = save(tmp_path / "nan.npz", data)
    refused(run("prune", "--model", qwen_model, "--saliency", nan, "--n-prune", 2, "--output", out),
            needles=(f"--saliency {nan}: 'freq' is nan",), absent=(out,))


def test_ui_analysis_reads_through_the_same_validator(tmp_path):
    from mlx_fun.ui.analysis import compare

    save(tmp_path / "a.npz", arrays(seed=1))
    data = arrays(seed=2)
    data["ean_sum"][0, 2] = np.nan
    save(tmp_path / "b.npz", data)
    with pytest.raises(UserError, match=r"'ean_sum' is nan at MoE layer position 0, expert 2"):
        compare(root=tmp_path, files=["a.npz", "b.npz"])


# ------------------------------------------------------------------------------- row 22: name the real problem
def test_stats_diff_names_the_wrong_shaped_array_and_a_directory(tmp_path):
    good = save(tmp_path / "good.npz", arrays(seed=1))
    data = arrays(seed=2)
    data["freq"] = data["freq"][:, :4]
    bad = save(tmp_path / "bad.npz", data)
    before = digest(good, bad)
    out = tmp_path / "d.json"
    refused(run("stats-diff", "--file1", good, "--file2", bad, "--output", out),
            needles=(f"--file2 {bad}: 'freq' has shape (2, 4)", "'weighted_freq_sum'",
                     "its num_layers / num_experts say (2, 8)"), absent=(out,))
    del data["num_layers"], data["num_experts"]  # another tool's file: the arrays' majority decides
    save(bad, data)
    refused(run("stats-diff", "--file1", good, "--file2", bad),
            needles=("'freq' has shape (2, 4), but 'weighted_freq_sum', 'reap_sum'",))
    folder = tmp_path / "folder.npz"
    folder.mkdir()
    refused(run("stats-diff", "--file1", good, "--file2", folder, "--output", out),
            needles=(f"--file2 {folder} is a directory, not a saliency file",), absent=(out,))
    assert digest(good) == before[:1] and list(folder.iterdir()) == []


def test_load_checks_the_rest_of_the_file(tmp_path):
    data = arrays()
    data["moe_layer_indices"] = np.array([0, 1, 2])
    with pytest.raises(UserError, match=r"moe_layer_indices lists 3 layers but its arrays have 2 rows"):
        SaliencyAccumulator.load(save(tmp_path / "a.npz", data))
    data = arrays()
    data["reap_sum"] = np.array([["x"] * 8] * 2)
    with pytest.raises(UserError, match=r"'reap_sum' holds <U1 values, not numbers"):
        SaliencyAccumulator.load(save(tmp_path / "b.npz", data))
    data = arrays()
    data["rank_sum_reap"], data["rank_files"] = np.full((2, 8), np.nan), np.array(2.0)
    with pytest.raises(UserError, match=r"'rank_sum_reap' is nan"):
        SaliencyAccumulator.load(save(tmp_path / "c.npz", data))
    acc = SaliencyAccumulator.load(save(tmp_path / "ok.npz", arrays()), name="saliency")
    assert acc.freq.dtype == np.float64 and acc.missing == [] and acc.source.endswith("ok.npz")


# ------------------------------------------------------------------ issue 41 row 11: the numbers outside the arrays
@pytest.mark.parametrize("key,value,needle", [
    ("total_tokens", np.array(-5), "'total_tokens' is -5, but must be whole number(s) of 0 or more"),
    ("total_tokens", np.array(np.nan), "'total_tokens' is nan"),
    ("total_tokens", np.array(2.5), "'total_tokens' is 2.5"),
    ("total_tokens", np.array([1, 2]), "'total_tokens' is [1 2]"),
    ("top_k", np.array(-1), "'top_k' is -1, but must be whole number(s) of 0..8"),
    ("top_k", np.array(9), "'top_k' is 9, but must be whole number(s) of 0..8"),
    ("moe_layer_indices", np.array([-1, 1]), "'moe_layer_indices' is [-1  1], but must be whole number(s) of 0 or"),
    ("moe_layer_indices", np.array([1, 1]), "'moe_layer_indices' lists a layer twice"),
])
def test_every_number_of_the_file_is_checked_in_its_range(tmp_path, key, value, needle):
    """A negative total_tokens (and any other out-of-range count) passed the one validator."""
    good = save(tmp_path / "good.npz", arrays(seed=1))
    data = arrays(seed=2)
    data[key] = value
    bad = save(tmp_path / "bad.npz", data)
    before, out = digest(good, bad), tmp_path / "out.npz"
    with pytest.raises(UserError, match="^saliency file .*" + __import__("re").escape(needle)):
        SaliencyAccumulator.load(bad)
    refused(run("stats-merge", "--files", good, "--files", bad, "--output", out), needles=("--files", needle),
            absent=(out,))
    assert digest(good, bad) == before
