"""stats-diff / stats-merge / stats-purge on hand-built 2-layer x 6-expert saliency files with known numbers."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from mlx_fun.observe import stats
from mlx_fun.cli import main
from mlx_fun.errors import UserError
from mlx_fun.observe.saliency import ARRAY_KEYS, SaliencyAccumulator

MOE = [1, 3]  # decoder-layer indices of the two MoE layers

# reap scores (reap_sum / reap_count) chosen to be exact in binary
REAP_A = [[4, 3, 2, 1, 0.5, 0], [1, 1, 5, 2, 3, 0.25]]
REAP_B = [[2, 3, 4, 0.5, 0.5, 1], [1, 2, 1, 2, 6, 0.25]]
REAP_C = [[0, 1, 2, 3, 4, 5], [6, 5, 4, 3, 2, 1]]
COUNT_A = [[10, 8, 2, 5, 1, 0], [4, 3, 12, 6, 2, 1]]
FREQ_A = [[10, 8, 2, 5, 3, 0], [4, 3, 12, 6, 2, 4]]
NORM_A = [[5, 1, 9, 2, 3, 0], [1, 2, 3, 7, 4, 8]]


def make_acc(reap, count=None, freq=None, max_norm=None, num_experts=6, model_type="qwen3_moe"):
    reap = np.asarray(reap, dtype=np.float64)
    count = np.full(reap.shape, 4.0) if count is None else np.asarray(count, dtype=np.float64)
    acc = SaliencyAccumulator(reap.shape[0], num_experts, model_type=model_type, moe_layer_indices=MOE, top_k=2)
    acc.reap_count[...] = count
    acc.freq[...] = count if freq is None else np.asarray(freq, dtype=np.float64)
    acc.reap_sum[...] = reap * count
    acc.ean_sum[...] = 2 * reap * count
    acc.weighted_freq_sum[...] = 0.5 * acc.freq
    acc.max_activation_norm[...] = 3 * reap if max_norm is None else np.asarray(max_norm, dtype=np.float64)
    acc.total_tokens = 100
    return acc


@pytest.fixture
def files(tmp_path):
    a = make_acc(REAP_A, count=COUNT_A, freq=FREQ_A, max_norm=NORM_A)  # layer 0 expert 5 unseen: scores 0
    paths = {
        "a": a.save(tmp_path / "a.npz"),
        "b": make_acc(REAP_B).save(tmp_path / "b.npz"),
        "c": make_acc(REAP_C).save(tmp_path / "c.npz"),
        "wide": make_acc(np.ones((2, 8)), num_experts=8).save(tmp_path / "wide.npz"),
    }
    return {k: str(v) for k, v in paths.items()}


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_user_error(result, *words):
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert err.startswith("Error:") and "\n" not in err, err
    for w in words:
        assert w in err, err
    assert "Traceback" not in result.output


# ------------------------------------------------------------------------------------------------- diff
DIFF_AB = np.array([[2, 0, -2, 0.5, 0, -1], [0, -1, 4, 0, -3, 0]], dtype=np.float64)


def test_diff_library_matches_hand_computation(files):
    a, b = SaliencyAccumulator.load(files["a"]), SaliencyAccumulator.load(files["b"])
    r = stats.diff(a, b, "reap")
    np.testing.assert_array_equal(np.array(r["diff"]), DIFF_AB)
    assert r["stats"] == {"mean": -0.5 / 12, "std": pytest.approx(DIFF_AB.std()), "min": -3.0, "max": 4.0}
    assert r["distribution"] == {"positive": 3, "negative": 4, "zero": 5, "total": 12}
    keys = ("layer", "moe_layer", "expert", "diff", "value1", "value2")
    top_pos = [tuple(e[k] for k in keys) for e in r["top_positive"]]
    assert top_pos == [(1, 3, 2, 4.0, 5.0, 1.0), (0, 1, 0, 2.0, 4.0, 2.0), (0, 1, 3, 0.5, 1.0, 0.5)]
    top_neg = [(e["layer"], e["expert"], e["diff"]) for e in r["top_negative"]]
    assert top_neg == [(1, 4, -3.0), (0, 2, -2.0), (0, 5, -1.0), (1, 1, -1.0)]  # ties keep (layer, expert) order
    assert r["shape"] == [2, 6] and r["metric"] == "reap" and r["warnings"] == []
    json.dumps(r)  # JSON-serialisable as is


def test_diff_top_lists_hold_ten():
    rng = np.random.default_rng(0)
    a, b = make_acc(rng.random((2, 6)) * 8), make_acc(rng.random((2, 6)) * 8)
    r = stats.diff(a, b, "reap")
    d = np.array(r["diff"]).ravel()
    assert [e["diff"] for e in r["top_positive"]] == sorted(d[d > 0], reverse=True)[:10]
    assert [e["diff"] for e in r["top_negative"]] == sorted(d[d < 0])[:10]
    assert len(r["top_positive"]) + len(r["top_negative"]) == min(10, (d > 0).sum()) + min(10, (d < 0).sum())


def test_stats_diff_cli_prints_and_writes_report(files, tmp_path):
    out = tmp_path / "reports" / "diff.json"
    res = run("stats-diff", "--file1", files["a"], "--file2", files["b"], "--output", out)
    assert res.exit_code == 0, res.output
    text = res.stdout
    assert "3 positive (file1 > file2), 4 negative (file1 < file2), 5 zero" in text
    lines = text.splitlines()
    i = lines.index("Top positive differences (file1 > file2):")
    assert lines[i + 1].split() == ["layer", "moe_layer", "expert", "diff", "file1", "file2"]
    assert lines[i + 2].split() == ["1", "3", "2", "4", "5", "1"]
    assert len({len(l) for l in lines[i + 1:i + 5]}) == 1  # aligned columns
    j = lines.index("Top negative differences (file1 < file2):")
    assert lines[j + 2].split() == ["1", "3", "4", "-3", "3", "6"]
    report = json.loads(out.read_text())
    assert report["file1"] == files["a"] and report["distribution"]["zero"] == 5
    np.testing.assert_array_equal(np.array(report["diff"]), DIFF_AB)


def test_stats_diff_freq_metric(files):
    res = run("stats-diff", "--file1", files["a"], "--file2", files["b"], "--metric", "freq")
    assert res.exit_code == 0, res.output
    # freq A - 4 everywhere: largest positive is layer 1 expert 2 (12 - 4), most negative layer 0 expert 5 (0 - 4)
    lines = res.stdout.splitlines()
    first_pos = lines[lines.index("Top positive differences (file1 > file2):") + 2]
    first_neg = lines[lines.index("Top negative differences (file1 < file2):") + 2]
    assert first_pos.split() == ["1", "3", "2", "8", "12", "4"]
    assert first_neg.split() == ["0", "1", "5", "-4", "0", "4"]


def test_stats_diff_via_subprocess(files):
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_fun", "stats-diff", "--file1", files["a"], "--file2", files["b"]],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "3 positive (file1 > file2), 4 negative (file1 < file2), 5 zero" in proc.stdout
    assert "Top negative differences" in proc.stdout


def test_stats_diff_mismatch_and_missing(files, tmp_path):
    assert_user_error(run("stats-diff", "--file1", files["a"], "--file2", files["wide"]), "num_experts", "6", "8")
    assert_user_error(run("stats-diff", "--file1", files["a"], "--file2", tmp_path / "nope.npz"), "nope.npz")
    res = run("stats-diff", "--file1", files["a"], "--file2", files["b"], "--output", files["b"])
    assert_user_error(res, "is the input given to --file2")
    assert SaliencyAccumulator.load(files["b"]).reap_count.sum() == 48  # still the saliency file


def test_model_type_mismatch_is_refused(files):
    other = make_acc(REAP_B, model_type="mixtral")
    with pytest.raises(UserError, match="model_type"):
        stats.diff(SaliencyAccumulator.load(files["a"]), other)


# ------------------------------------------------------------------------------------------------- merge
RANK_A = np.array([[1, 2, 3, 4, 5, 6], [4.5, 4.5, 1, 3, 2, 6]])
RANK_B = np.array([[3, 2, 1, 5.5, 5.5, 4], [4.5, 2.5, 4.5, 2.5, 1, 6]])
RANK_C = np.array([[6, 5, 4, 3, 2, 1], [1, 2, 3, 4, 5, 6]])


def test_layer_ranks_by_hand(files):
    for key, want in (("a", RANK_A), ("b", RANK_B), ("c", RANK_C)):
        np.testing.assert_array_equal(stats.layer_ranks(SaliencyAccumulator.load(files[key]).scores("reap")), want)


def test_layer_ranks_are_scipys_average_ranks():
    """layer_ranks, without importing scipy.stats, is rankdata(-scores, method="average", axis=1): ties, infinities,
    and rows holding a NaN (all NaN, scipy's nan_policy="propagate")."""
    from scipy.stats import rankdata

    rng = np.random.default_rng(0)
    for _ in range(60):
        x = rng.integers(0, 4, size=(3, 7)).astype(np.float64)
        x[rng.random(x.shape) < 0.05] = np.inf
        x[rng.random(x.shape) < 0.05] = -np.inf
        x[rng.random(x.shape) < 0.03] = np.nan
        np.testing.assert_array_equal(stats.layer_ranks(x), rankdata(-x, method="average", axis=1))


def test_stats_merge_cli_rank_sums_and_scores(files, tmp_path):
    out = tmp_path / "merged.npz"
    res = run("stats-merge", "--files", files["a"], "--files", files["b"], "--output", out)
    assert res.exit_code == 0, res.output
    assert str(out) in res.stdout and "observed 3 .. 12" in res.stdout and "[2, 12]" in res.stdout

    merged = SaliencyAccumulator.load(out)
    rank_sum = merged.extra["rank_sum_reap"]
    np.testing.assert_array_equal(rank_sum, [[4, 4, 4, 9.5, 10.5, 10], [9, 7, 5.5, 5.5, 3, 12]])
    assert float(merged.extra["rank_files"]) == 2.0 and str(merged.extra["rank_metric"]) == "reap"
    assert ((rank_sum >= 2) & (rank_sum <= 12)).all()
    # scores = n*(E+1) - rank_sum: higher = better; layer 1 best is expert 4 (ranked 2nd and 1st)
    scores = merged.scores("reap")
    np.testing.assert_array_equal(scores, 14 - rank_sum)
    assert list(np.argsort(-scores[1], kind="stable")) == [4, 2, 3, 1, 0, 5]
    assert list(np.argsort(-scores[0], kind="stable")) == [0, 1, 2, 3, 5, 4]
    # raw statistics are summed (max norm: maximum) and the model identity kept
    a, b = SaliencyAccumulator.load(files["a"]), SaliencyAccumulator.load(files["b"])
    np.testing.assert_array_equal(merged.freq, a.freq + b.freq)
    np.testing.assert_array_equal(merged.scores("freq"), a.freq + b.freq)
    np.testing.assert_array_equal(merged.max_activation_norm, np.maximum(a.max_activation_norm, b.max_activation_norm))
    assert merged.moe_layer_indices == MOE and merged.model_type == "qwen3_moe" and merged.total_tokens == 200


def test_rank_merge_commutative_and_sums_originals(files):
    a, b, c = (SaliencyAccumulator.load(files[k]) for k in "abc")
    for metric in ("reap", "freq"):
        abc = stats.rank_merge([a, b, c], metric)
        for perm in ([c, a, b], [b, c, a], [c, b, a]):
            other = stats.rank_merge(perm, metric)
            np.testing.assert_array_equal(other.extra[f"rank_sum_{metric}"], abc.extra[f"rank_sum_{metric}"])
            for key in ARRAY_KEYS:
                np.testing.assert_array_equal(getattr(other, key), getattr(abc, key))
    abc = stats.rank_merge([a, b, c], "reap")
    np.testing.assert_array_equal(abc.extra["rank_sum_reap"], RANK_A + RANK_B + RANK_C)
    assert abc.extra["rank_sum_reap"].max() == 18  # layer 1 expert 5 is last everywhere: n * E
    # re-merging a merged file is a different thing (it counts as one dataset), as documented
    nested = stats.rank_merge([stats.rank_merge([a, b], "reap"), c], "reap")
    assert float(nested.extra["rank_files"]) == 2.0
    assert not np.array_equal(nested.extra["rank_sum_reap"], abc.extra["rank_sum_reap"])


def test_stats_merge_errors(files, tmp_path):
    assert_user_error(run("stats-merge", "--files", files["a"], "--output", tmp_path / "m.npz"), "at least 2")
    res = run("stats-merge", "--files", files["a"], "--files", files["wide"], "--output", tmp_path / "m.npz")
    assert_user_error(res, "num_experts", "6", "8")
    assert not (tmp_path / "m.npz").exists()
    before = open(files["b"], "rb").read()
    res = run("stats-merge", "--files", files["a"], "--files", files["b"], "--output", files["b"])
    assert_user_error(res, "is the input given to --files")
    assert open(files["b"], "rb").read() == before
    assert_user_error(
        run("stats-merge", "--files", files["a"], "--files", tmp_path / "x.npz", "--output", tmp_path / "m.npz"),
        "x.npz",
    )


# ------------------------------------------------------------------------------------------------- purge
def test_stats_purge_cli_zeros_expected_entries(files, tmp_path):
    out = tmp_path / "purged.npz"
    res = run("stats-purge", "--input", files["a"], "--output", out,
              "--min-freq", 3, "--min-count", 2, "--max-norm", 6)
    assert res.exit_code == 0, res.output
    assert "12 expert-layer pairs, 5 purged, 7 kept" in res.stdout
    filter_lines = [l.split() for l in res.stdout.splitlines() if l.strip().startswith(("freq", "reap_count", "max_"))]
    rows = {" ".join(f[:3]): f[3] for f in filter_lines}
    assert rows == {"freq < 3": "3", "reap_count < 2": "3", "max_activation_norm > 6": "3"}

    a, p = SaliencyAccumulator.load(files["a"]), SaliencyAccumulator.load(out)
    mask = np.zeros((2, 6), dtype=bool)
    mask[0, [2, 4, 5]] = True  # freq 2, count 1, freq 0
    mask[1, [4, 5]] = True  # freq 2, count 1
    for key in ARRAY_KEYS:
        arr, orig = getattr(p, key), getattr(a, key)
        assert arr.shape == (2, 6)
        assert (arr[mask] == 0).all(), key
        np.testing.assert_array_equal(arr[~mask], orig[~mask])
    assert p.max_activation_norm[1, 3] == 7  # over --max-norm but kept: reported, not capped
    assert p.moe_layer_indices == MOE and p.total_tokens == a.total_tokens


def test_purge_library_report(files):
    a = SaliencyAccumulator.load(files["a"])
    purged, rep = stats.purge(a, max_norm=6)
    assert (rep["total"], rep["purged"], rep["kept"]) == (12, 0, 12)
    assert rep["by_filter"] == {"freq": 0, "count": 0, "norm_over": 3}
    over = [(e["layer"], e["moe_layer"], e["expert"]) for e in rep["norm_over_entries"]]
    assert over == [(0, 1, 2), (1, 3, 3), (1, 3, 5)]
    np.testing.assert_array_equal(purged.max_activation_norm, a.max_activation_norm)
    _, rep = stats.purge(a, min_freq=100)
    assert rep["purged"] == 12 and rep["layers_fully_purged"] == [0, 1]
    np.testing.assert_array_equal(a.freq, FREQ_A)  # input untouched


def test_purge_rank_merged_file_scores_zero(files):
    merged = stats.rank_merge([SaliencyAccumulator.load(files[k]) for k in "ab"], "reap")
    purged, rep = stats.purge(merged, min_freq=7)  # summed freq: a + 4
    mask = merged.freq < 7
    assert rep["purged"] == int(mask.sum()) > 0
    scores = purged.scores("reap")
    assert (scores[mask] == 0).all() and (scores[~mask] == merged.scores("reap")[~mask]).all()
    assert (scores[~mask] > 0).all()


def test_stats_purge_errors(files, tmp_path):
    before = open(files["a"], "rb").read()
    assert_user_error(run("stats-purge", "--input", files["a"], "--output", tmp_path / "p.npz"), "at least one filter")
    assert_user_error(run("stats-purge", "--input", files["a"], "--output", files["a"], "--min-freq", 3), "is the input given to --input")
    assert open(files["a"], "rb").read() == before
    assert_user_error(run("stats-purge", "--input", tmp_path / "none.npz", "--output", tmp_path / "p.npz",
                          "--min-freq", 1), "none.npz")
    assert not (tmp_path / "p.npz").exists()
    freq_only = make_acc(REAP_B, count=np.zeros((2, 6)), freq=np.full((2, 6), 4.0))
    freq_only.save(tmp_path / "f.npz")
    assert_user_error(run("stats-purge", "--input", tmp_path / "f.npz", "--output", tmp_path / "p.npz",
                          "--min-count", 1), "reap_count")


def test_stats_purge_refuses_thresholds_that_purge_every_expert(files, tmp_path):
    """Issue 41 row 12: `stats-purge --min-freq 1e300` wrote a file with every expert purged (it ranks nothing)."""
    a = SaliencyAccumulator.load(files["a"])
    top_freq, out = float(a.freq.max()), tmp_path / "p.npz"
    assert_user_error(run("stats-purge", "--input", files["a"], "--output", out, "--min-freq", "1e300"),
                      "--min-freq 1e+300 purges every expert", f"the largest freq in the file is {top_freq:g}",
                      f"pass a --min-freq of at most {top_freq:g}")
    assert not out.exists()
    assert run("stats-purge", "--input", files["a"], "--output", out, "--min-freq", top_freq).exit_code == 0


def test_help_texts():
    res = run("--help")
    assert res.exit_code == 0
    for name in ("stats-diff", "stats-merge", "stats-purge"):
        line = next(l for l in res.stdout.splitlines() if l.strip().startswith(name))
        assert len(line.split(name, 1)[1].strip()) > 10 and not line.rstrip().endswith("...")
        sub = run(name, "--help")
        assert sub.exit_code == 0 and "--output" in sub.stdout
