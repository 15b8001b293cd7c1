"""Expert selection: strategies, model-wide, protection/targeting, groups, top_k limits, expert lists, reports."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_fun.errors import UserError
from mlx_fun.experts.expert_files import load_expert_list, load_report_experts, merge_expert_sets, save_expert_list
from mlx_fun.experts.selection import (
    check_keep_counts,
    parse_expert_ranges,
    select_bottom,
    select_experts,
    select_strided,
)


# ------------------------------------------------------------------------------------------- range parsing
def test_parse_expert_ranges():
    assert parse_expert_ranges("1,2,250..255") == [1, 2, 250, 251, 252, 253, 254, 255]
    assert parse_expert_ranges(" 7 , 3 .. 5,3") == [3, 4, 5, 7]
    assert parse_expert_ranges("4..4") == [4]
    assert parse_expert_ranges("0,63", num_experts=64) == [0, 63]


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "is empty"),
        ("   ", "is empty"),
        ("1,,2", "empty entry"),
        ("1,2,", "empty entry"),
        ("1,abc", "'abc' is not a non-negative integer"),
        ("-1", "'-1' is not a non-negative integer"),
        ("1-3", "'1-3' is not a non-negative integer"),
        ("5..3", r"range '5\.\.3' is reversed; write it as 3\.\.5"),
        ("1..x", r"'1\.\.x' is not a range"),
        ("..4", r"'\.\.4' is not a range"),
        ("2,60..70", r"'60\.\.70' is out of range; the model has 64 experts"),
    ],
)
def test_parse_expert_ranges_errors(text, match):
    with pytest.raises(UserError, match=match) as ei:
        parse_expert_ranges(text, num_experts=64)
    assert "ignore_experts=" in str(ei.value) and "\n" not in str(ei.value)


# ------------------------------------------------------------------------------------------- strategies
def test_strided_seed_example_160_experts():
    """160 experts, n=40. Expert i gets rank i (rank 0 = most important).

    Important group = ranks 0..119, 20 removed with stride 120/20 = 6: "every 6th" = sorted positions
    5, 11, ..., 119. Unimportant group = ranks 120..159, 20 removed with stride 40/20 = 2: group positions
    1, 3, ..., 39 = ranks 121, 123, ..., 159.
    """
    rng = np.random.default_rng(0)
    perm = rng.permutation(160)  # expert perm[r] has rank r
    scores = np.empty(160)
    scores[perm] = 1000.0 - np.arange(160)  # descending by rank
    kept = select_strided(scores, 40)
    assert len(kept) == 120 and kept == sorted(set(kept))
    rank_of = np.empty(160, dtype=int)
    rank_of[perm] = np.arange(160)
    removed_ranks = sorted(rank_of[e] for e in set(range(160)) - set(kept))
    assert len(removed_ranks) == 40
    important = [r for r in removed_ranks if r < 120]
    unimportant = [r for r in removed_ranks if r >= 120]
    assert important == list(range(5, 120, 6))
    assert unimportant == list(range(121, 160, 2))
    assert len(important) == len(unimportant) == 20
    assert set(np.diff(important)) == {6} and set(np.diff(unimportant)) == {2}  # evenly spaced
    # select_experts gives the same answer
    out = select_experts(scores[None, :], 40, top_k=8, strategy="strided")
    assert out[0] == kept


def test_strided_odd_and_small():
    s = np.arange(10.0)[::-1]  # expert i has rank i
    # n=1: the odd removal comes from the unimportant group = the least important expert
    assert select_strided(s, 1) == list(range(9))
    # n=5: important group ranks 0..4 loses 2 (positions 1,4 -> stride 2.5), unimportant ranks 5..9 loses 3
    # (positions floor(5/3)-1=0, floor(10/3)-1=2, 4 -> ranks 5, 7, 9)
    assert sorted(set(range(10)) - set(select_strided(s, 5))) == [1, 4, 5, 7, 9]
    assert select_strided(s, 0) == list(range(10))
    # heavy pruning: the important group never loses more than half of itself
    kept = select_strided(s, 8)
    assert len(kept) == 2 and 0 in kept


def test_bottom_removes_exactly_the_lowest():
    s = np.array([0.5, 0.1, 0.9, 0.05, 0.7, 0.3])
    assert select_bottom(s, 2) == [0, 2, 4, 5]
    assert select_bottom(s, 0) == list(range(6))
    # ties: the higher index is removed first (lower index counts as more important)
    assert select_bottom(np.zeros(4), 1) == [0, 1, 2]
    assert select_strided(np.zeros(4), 1) == [0, 1, 2]
    with pytest.raises(UserError, match="n_prune= 6 must be between 0 and 5"):
        select_bottom(s, 6)


def test_per_layer_independent():
    S = np.array([[1.0, 5, 2, 9], [4, 0, 1, 1]])
    assert select_experts(S, 1, top_k=2) == {0: [1, 2, 3], 1: [0, 2, 3]}


# ------------------------------------------------------------------------------------------- model-wide
def test_model_wide_column_sums_hand_example():
    S = np.array([[1.0, 5, 2, 9], [4, 0, 1, 1]])  # column sums 5, 5, 3, 10
    assert select_experts(S, 1, top_k=2, model_wide=True) == {0: [0, 1, 3], 1: [0, 1, 3]}
    # n=2: expert 2 (3) then the tie 0/1 at 5 -> the higher index (1) goes
    assert select_experts(S, 2, top_k=2, model_wide=True) == {0: [0, 3], 1: [0, 3]}
    # ignore-experts protect columns in every layer
    assert select_experts(S, 1, top_k=2, model_wide=True, ignore_experts=[2]) == {0: [0, 2, 3], 1: [0, 2, 3]}
    ign = parse_expert_ranges("0..2", num_experts=4)
    with pytest.raises(UserError, match="only 1 removable"):
        select_experts(S, 2, top_k=2, model_wide=True, ignore_experts=ign)
    assert select_experts(S, 1, top_k=2, model_wide=True, ignore_experts=ign) == {0: [0, 1, 2], 1: [0, 1, 2]}


def test_model_wide_protect_and_target_any_layer():
    S = np.array([[1.0, 5, 2, 9], [4, 0, 1, 1]])
    # expert 2 protected only in layer 1 -> its column is protected everywhere; next lowest: tie 0/1 -> 1 goes
    assert select_experts(S, 1, top_k=2, model_wide=True, protected={1: {2}}) == {0: [0, 2, 3], 1: [0, 2, 3]}
    # expert 3 targeted in layer 0 -> removed everywhere despite the highest sum
    assert select_experts(S, 1, top_k=2, model_wide=True, targeted={0: {3}}) == {0: [0, 1, 2], 1: [0, 1, 2]}


def test_min_experts_per_layer():
    S = np.zeros((2, 8))
    assert len(select_experts(S, 4, top_k=2, model_wide=True, min_experts_per_layer=4)[0]) == 4
    with pytest.raises(UserError, match="would keep 3 experts per layer but min_experts_per_layer= is 4; prune at most 4"):
        select_experts(S, 5, top_k=2, model_wide=True, min_experts_per_layer=4)
    with pytest.raises(UserError, match="min_experts_per_layer= must be at least 1"):
        select_experts(S, 1, top_k=2, model_wide=True, min_experts_per_layer=0)


# ------------------------------------------------------------------------------------------- protect / target
def test_protected_and_targeted():
    s = np.array([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])
    assert select_experts(s, 2, top_k=2, protected={0}) == {0: [0, 3, 4, 5]}
    assert select_experts(s, 2, top_k=2, protected={0: {0, 1}}) == {0: [0, 1, 4, 5]}
    assert select_experts(s, 2, top_k=2, targeted={5}) == {0: [1, 2, 3, 4]}
    # more targeted than n: only targeted experts go, the least salient of them
    assert select_experts(s, 2, top_k=2, targeted={3, 4, 5}) == {0: [0, 1, 2, 5]}
    # protection wins over targeting
    assert select_experts(s, 1, top_k=2, targeted={5}, protected={5}) == {0: [1, 2, 3, 4, 5]}
    # strided works on the removable pool only
    kept = select_experts(s, 2, top_k=2, strategy="strided", protected={0, 1})
    assert {0, 1} <= set(kept[0]) and len(kept[0]) == 4


def test_too_many_protected():
    s = np.zeros((2, 8))
    with pytest.raises(UserError) as ei:
        select_experts(s, 3, top_k=2, protected={1: set(range(6))})
    msg = str(ei.value)
    assert "only 2 removable expert(s) in layer 7" not in msg  # no moe_layer_indices given
    assert "only 2 removable expert(s) in MoE layer #1" in msg and "prune at most 2" in msg
    with pytest.raises(UserError, match="in layer 7; n_prune= 3 is too many: prune at most 2"):
        select_experts(s, 3, top_k=2, protected={1: set(range(6))}, moe_layer_indices=[3, 7])
    with pytest.raises(UserError, match="out of range; the model has 8 experts"):
        select_experts(s, 1, top_k=2, protected={9})
    with pytest.raises(UserError, match="name MoE layer #5"):
        select_experts(s, 1, top_k=2, protected={5: {1}})


# ------------------------------------------------------------------------------------------- errors / limits
def test_ignore_without_model_wide():
    with pytest.raises(UserError, match="ignore_experts= only works with model_wide="):
        select_experts(np.zeros((1, 8)), 1, top_k=2, ignore_experts=[1])
    with pytest.raises(UserError, match="ignore_experts=: expert 9 is out of range"):
        select_experts(np.zeros((1, 8)), 1, top_k=2, model_wide=True, ignore_experts=[9])


def test_top_k_limits_and_warning():
    S = np.random.default_rng(1).random((3, 8))
    with pytest.raises(UserError, match="would keep 1 experts but top_k is 2; prune at most 6"):
        select_experts(S, 7, top_k=2)
    with pytest.raises(UserError, match=r"n_prune= 8 is out of range.*8 experts"):
        select_experts(S, 8, top_k=2)
    with pytest.raises(UserError, match="n_prune= -1 is out of range"):
        select_experts(S, -1, top_k=2)
    with pytest.raises(UserError, match="unknown strategy="):
        select_experts(S, 1, top_k=2, strategy="random")
    assert select_experts(S, 0, top_k=2) == {p: list(range(8)) for p in range(3)}
    kept = select_experts(S, 6, top_k=2)  # exactly top_k: allowed, with a warning
    assert all(len(v) == 2 for v in kept.values())
    warns = check_keep_counts(kept, 8, 2)
    assert len(warns) == 1 and "exactly top_k = 2" in warns[0] and "every layer" in warns[0]
    assert check_keep_counts(select_experts(S, 5, top_k=2), 8, 2) == []


def test_check_keep_counts_errors():
    with pytest.raises(UserError, match="layer 5 would keep 1 experts but top_k is 2"):
        check_keep_counts({0: [0, 1, 2], 1: [3]}, 8, 2, moe_layer_indices=[4, 5])
    with pytest.raises(UserError, match="different numbers of experts.*layer 4: 3.*layer 5: 4"):
        check_keep_counts({0: [0, 1, 2], 1: [0, 1, 2, 3]}, 8, 2, moe_layer_indices=[4, 5])
    assert check_keep_counts({0: [0, 1, 2], 1: [0, 1, 2, 3]}, 8, 2, require_uniform=False) == []
    with pytest.raises(UserError, match=r"keeps \[3, 1\] experts in its 2 groups"):
        check_keep_counts({0: [0, 1, 2, 4]}, 8, 2, groups=(2, 1))
    with pytest.raises(UserError, match="keeps 1 expert\\(s\\) per group"):
        check_keep_counts({0: [0, 4]}, 8, 1, groups=(2, 1))
    with pytest.raises(UserError, match="keeps expert 8, out of range"):
        check_keep_counts({0: [0, 8]}, 8, 1)
    warns = check_keep_counts({0: [0, 1], 1: [0, 1, 2]}, 8, 2, require_uniform=False, moe_layer_indices=[2, 3])
    assert len(warns) == 1 and warns[0].startswith("layer 2 keeps exactly top_k")


# ------------------------------------------------------------------------------------------- groups
def test_groups_balanced_and_errors():
    rng = np.random.default_rng(3)
    S = rng.random((2, 16))  # 4 groups of 4
    kept = select_experts(S, 4, top_k=4, groups=(4, 2))
    for ex in kept.values():
        assert np.bincount(np.array(ex) // 4, minlength=4).tolist() == [3, 3, 3, 3]
    # each group is pruned by its own lowest
    for p, ex in kept.items():
        for g in range(4):
            grp = S[p, 4 * g : 4 * g + 4]
            assert 4 * g + int(np.argmin(grp)) not in ex
    assert check_keep_counts(kept, 16, 4, groups=(4, 2)) == []
    with pytest.raises(UserError) as ei:
        select_experts(S, 6, top_k=4, groups=(4, 2))
    msg = str(ei.value)
    assert "not a multiple of n_group=4" in msg and "valid values: 0, 4, 8" in msg
    with pytest.raises(UserError, match="leave 1 expert\\(s\\) in each of the 4 groups.*at least 2.*prune at most 8"):
        select_experts(S, 12, top_k=2, groups=(4, 4))
    with pytest.raises(UserError, match="topk_group=1 selected groups hold only 2 experts but top_k is 4"):
        select_experts(S, 8, top_k=4, groups=(4, 1))
    # model-wide with groups: column sums per group
    mw = select_experts(S, 4, top_k=4, groups=(4, 2), model_wide=True)
    cols = S.sum(0)
    assert mw[0] == mw[1]
    assert sorted(set(range(16)) - set(mw[0])) == [4 * g + int(np.argmin(cols[4 * g : 4 * g + 4])) for g in range(4)]
    # protection inside one group limits every group
    with pytest.raises(UserError, match="only 1 removable expert\\(s\\) in MoE layer #0, group 2.*prune at most 4"):
        select_experts(S, 8, top_k=2, groups=(4, 4), protected={0: {8, 9, 10}})
    # groups=(1, x) or None: no groups
    assert select_experts(S, 3, top_k=2, groups=(1, 1)) == select_experts(S, 3, top_k=2)


# ------------------------------------------------------------------------------------------- property tests
@st.composite
def problems(draw, with_groups=False):
    if with_groups:
        n_group = draw(st.sampled_from([2, 4]))
        gs = draw(st.integers(2, 8))
        E = n_group * gs
        n = n_group * draw(st.integers(0, gs - 1))
        groups = (n_group, draw(st.integers(1, n_group)))
    else:
        E = draw(st.integers(2, 64))
        n = draw(st.integers(0, E - 1))
        groups = None
    L = draw(st.integers(1, 4))
    top_k = draw(st.integers(1, max(1, E // 3)) | st.integers(1, E))  # mostly feasible, sometimes not
    scores = np.array(
        draw(st.lists(st.integers(0, 20), min_size=L * E, max_size=L * E)), dtype=np.float64
    ).reshape(L, E)
    sets = st.dictionaries(st.integers(0, L - 1), st.sets(st.integers(0, E - 1), max_size=max(1, E // 3)), max_size=L)
    protected = draw(st.none() | sets)
    targeted = draw(st.none() | sets)
    strategy = draw(st.sampled_from(["bottom", "strided"]))
    return dict(scores=scores, n=n, top_k=top_k, groups=groups, protected=protected, targeted=targeted, strategy=strategy)


PROP = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check_common(kept, p, E):
    L = p["scores"].shape[0]
    assert sorted(kept) == list(range(L))
    for pos, ex in kept.items():
        assert ex == sorted(set(ex))
        assert len(ex) == E - p["n"] >= p["top_k"]
        prot = (p["protected"] or {}).get(pos, set())
        assert prot <= set(ex)


@PROP
@given(problems())
def test_property_per_layer(p):
    S, n, E = p["scores"], p["n"], p["scores"].shape[1]
    try:
        kept = select_experts(S, n, top_k=p["top_k"], strategy=p["strategy"], protected=p["protected"], targeted=p["targeted"])
    except UserError:
        removable = min(E - len((p["protected"] or {}).get(pos, ())) for pos in range(S.shape[0]))
        assert E - n < p["top_k"] or removable < n  # only legitimate refusals
        return
    _check_common(kept, p, E)
    for pos, ex in kept.items():
        gone = set(range(E)) - set(ex)
        assert len(gone) == n
        prot = (p["protected"] or {}).get(pos, set())
        targ = (p["targeted"] or {}).get(pos, set()) - prot
        if len(targ) <= n:
            assert targ <= gone
        else:
            assert gone <= targ
        if p["strategy"] == "bottom" and not prot and not targ and n:
            assert max(S[pos, list(gone)]) <= min(S[pos, ex])


@PROP
@given(problems(), st.data())
def test_property_model_wide(p, data):
    S, n, E = p["scores"], p["n"], p["scores"].shape[1]
    ignore = data.draw(st.sets(st.integers(0, E - 1), max_size=max(1, E // 4)))
    try:
        kept = select_experts(
            S, n, top_k=p["top_k"], strategy=p["strategy"], model_wide=True, ignore_experts=ignore,
            protected=p["protected"], targeted=p["targeted"],
        )
    except UserError:
        prot_cols = set(ignore).union(*((p["protected"] or {}).values()))
        assert E - n < p["top_k"] or E - len(prot_cols) < n
        return
    _check_common(kept, p, E)
    first = kept[0]
    assert all(ex == first for ex in kept.values())  # same columns everywhere
    gone = set(range(E)) - set(first)
    assert len(gone) == n and not (gone & set(ignore))
    prot_cols = set(ignore).union(*((p["protected"] or {}).values()))
    targ_cols = set().union(*((p["targeted"] or {}).values())) - prot_cols
    if len(targ_cols) <= n:
        assert targ_cols <= gone
    else:
        assert gone <= targ_cols
    if p["strategy"] == "bottom" and not prot_cols and not targ_cols and n:
        cols = S.sum(0)
        assert max(cols[list(gone)]) <= min(cols[first])


@PROP
@given(problems(with_groups=True), st.booleans())
def test_property_groups(p, model_wide):
    S, n, E = p["scores"], p["n"], p["scores"].shape[1]
    n_group, topk_group = p["groups"]
    gs = E // n_group
    try:
        kept = select_experts(
            S, n, top_k=p["top_k"], strategy=p["strategy"], groups=p["groups"], model_wide=model_wide,
            protected=p["protected"], targeted=p["targeted"],
        )
    except UserError:
        m = n // n_group
        ok_counts = E - n >= p["top_k"] and gs - m >= 2 and topk_group * (gs - m) >= p["top_k"]
        assert not ok_counts or p["protected"]
        return
    _check_common(kept, p, E)
    for ex in kept.values():
        per = np.bincount(np.array(ex, dtype=int) // gs, minlength=n_group)
        assert set(per.tolist()) == {gs - n // n_group} and per.min() >= 2
    if not model_wide:  # targeted-first holds inside every group
        m = n // n_group
        for pos, ex in kept.items():
            gone = set(range(E)) - set(ex)
            prot = (p["protected"] or {}).get(pos, set())
            targ = (p["targeted"] or {}).get(pos, set()) - prot
            for g in range(n_group):
                grp = set(range(g * gs, (g + 1) * gs))
                tg, gg = targ & grp, gone & grp
                assert len(gg) == m
                assert tg <= gg if len(tg) <= m else gg <= tg
    assert check_keep_counts(kept, E, p["top_k"], groups=p["groups"]) is not None


@PROP
@given(st.integers(2, 64), st.data())
def test_property_strided_counts(E, data):
    n = data.draw(st.integers(0, E - 1))
    s = np.array(data.draw(st.lists(st.floats(-5, 5), min_size=E, max_size=E)))
    for fn in (select_strided, select_bottom):
        kept = fn(s, n)
        assert len(kept) == E - n and kept == sorted(set(kept)) and all(0 <= e < E for e in kept)
    if n:  # strided always removes the least important expert, never the most important when n <= E/2
        order = np.lexsort((-np.arange(E), s))
        kept = select_strided(s, n)
        assert int(order[0]) not in kept
        if 2 * n <= E:
            assert int(order[-1]) in kept


# ------------------------------------------------------------------------------------------- expert lists
MOE = [1, 3, 5]  # decoder-layer indices of the 3 MoE layers


def test_expert_list_json_round_trip(tmp_path):
    S = np.random.default_rng(5).random((3, 8))
    kept = select_experts(S, 3, top_k=2)
    path = save_expert_list(tmp_path / "filtered_experts.json", kept, num_experts=8, moe_layer_indices=MOE, model_type="qwen3_moe")
    data = json.loads(path.read_text())
    assert data["format"] == "mlx-fun-expert-list" and data["version"] == 1 and data["num_experts"] == 8
    assert sorted(data["layers"]) == ["1", "3", "5"] and all(len(v["remove"]) == 3 for v in data["layers"].values())
    assert load_expert_list(path, 3, 8, MOE) == kept
    assert not list(tmp_path.glob(".*tmp*"))


def test_expert_list_csv_round_trip(tmp_path):
    S = np.random.default_rng(6).random((3, 8))
    kept = select_experts(S, 2, top_k=2, model_wide=True)
    path = save_expert_list(tmp_path / "filtered_experts.csv", kept, num_experts=8, moe_layer_indices=MOE)
    lines = path.read_text().splitlines()
    assert lines[0] == "layer,expert,action" and len(lines) == 1 + 3 * 2
    assert load_expert_list(path, 3, 8, MOE) == kept


def test_expert_list_keep_absent_layers_and_comments(tmp_path):
    j = tmp_path / "a.json"
    j.write_text(json.dumps({"format": "mlx-fun-expert-list", "layers": {"3": {"keep": [7, 0, 2]}, "5": {"remove": []}}}))
    assert load_expert_list(j, 3, 8, MOE) == {0: list(range(8)), 1: [0, 2, 7], 2: list(range(8))}
    c = tmp_path / "a.csv"
    c.write_text("# exported\n\nLayer, Expert, Action\n1,4,REMOVE\n\n1,0,remove\n5,1,keep\n5,2,keep\n")
    assert load_expert_list(c, 3, 8, MOE) == {0: [1, 2, 3, 5, 6, 7], 1: list(range(8)), 2: [1, 2]}
    # sniffing without a known suffix
    t = tmp_path / "list.txt"
    t.write_text(j.read_text())
    assert load_expert_list(t, 3, 8, MOE)[1] == [0, 2, 7]
    h = tmp_path / "only_header.csv"
    h.write_text("layer,expert,action\n")
    assert load_expert_list(h, 3, 8, MOE) == {p: list(range(8)) for p in range(3)}


def _json_list(tmp_path, obj, raw=None):
    p = tmp_path / "bad.json"
    p.write_text(raw if raw is not None else json.dumps(obj))
    return p


GOOD = {"format": "mlx-fun-expert-list", "version": 1}


@pytest.mark.parametrize(
    "obj, raw, match",
    [
        (None, "{not json", "is not valid JSON"),
        (None, '{"format": "mlx-fun-expert-list", "layers": {"1": {"remove": [1]}, "1": {"remove": [2]}}}', "key '1' appears twice"),
        ([1, 2], None, "must be a JSON object"),
        ({"layers": {}}, None, '"format" is None'),
        ({**GOOD, "version": 2, "layers": {}}, None, "version 2 is not supported"),
        ({**GOOD, "mode": "shrink", "layers": {}}, None, '"mode" is \'shrink\''),
        ({**GOOD, "num_experts": 16, "layers": {}}, None, "made for a model with 16 experts per layer, but this model has 8"),
        ({**GOOD}, None, '"layers" is missing'),
        ({**GOOD, "layers": {"2": {"remove": [1]}}}, None, r"layer 2 is not an MoE layer of this model \(MoE layers: 1, 3, 5\)"),
        ({**GOOD, "layers": {"x": {"remove": [1]}}}, None, "layer 'x' is not an integer"),
        ({**GOOD, "layers": {"1": [1, 2]}}, None, "layer 1 must be an object"),
        ({**GOOD, "layers": {"1": {"remove": [1], "keep": [2]}}}, None, 'layer 1 has both "remove" and "keep"'),
        ({**GOOD, "layers": {"1": {}}}, None, 'layer 1 has neither of "remove" and "keep"'),
        ({**GOOD, "layers": {"1": {"removed": [1]}}}, None, "unknown key 'removed'"),
        ({**GOOD, "layers": {"1": {"remove": 3}}}, None, "must be a list"),
        ({**GOOD, "layers": {"3": {"remove": [8]}}}, None, r"layer 3 \"remove\" has expert 8, out of range 0..7"),
        ({**GOOD, "layers": {"3": {"keep": [-1]}}}, None, "has expert -1, out of range"),
        ({**GOOD, "layers": {"3": {"keep": [1, "2"]}}}, None, "has '2', which is not an integer"),
        ({**GOOD, "layers": {"3": {"keep": [1, True]}}}, None, "has True, which is not an integer"),
        ({**GOOD, "layers": {"5": {"remove": [4, 1, 4]}}}, None, "lists expert 4 twice"),
    ],
)
def test_expert_list_json_errors(tmp_path, obj, raw, match):
    path = _json_list(tmp_path, obj, raw)
    with pytest.raises(UserError, match=match) as ei:
        load_expert_list(path, 3, 8, MOE)
    assert str(path) in str(ei.value) and "\n" not in str(ei.value)


def test_expert_list_missing_file(tmp_path):
    with pytest.raises(UserError, match="does not exist; export it from the UI"):
        load_expert_list(tmp_path / "nope.json", 3, 8, MOE)


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "the CSV is empty"),
        ("layer,expert\n1,2\n", "line 1: expected the header 'layer,expert,action'"),
        ("layer,expert,action\n1,2,remove\n\n1,3\n", "line 4: expected 3 fields"),
        ("layer,expert,action\n1,2,remove\nx,3,remove\n", "line 3: layer 'x' is not an integer"),
        ("layer,expert,action\n1,2,remove\n4,3,remove\n", r"line 3: layer 4 is not an MoE layer of this model \(MoE layers: 1, 3, 5\)"),
        ("layer,expert,action\n1,8,remove\n", "line 2: expert 8 is out of range 0..7"),
        ("layer,expert,action\n1,-2,remove\n", "line 2: expert '-2' is not a non-negative integer"),
        ("layer,expert,action\n1,2,drop\n", "line 2: action 'drop' must be 'remove' or 'keep'"),
        ("layer,expert,action\n1,2,remove\n3,2,keep\n# note\n1,5,keep\n", r"line 5: layer 1 mixes 'keep' with 'remove' \(line 2\)"),
        ("layer,expert,action\n3,2,keep\n1,0,remove\n3,2,keep\n", r"line 4: expert 2 of layer 3 is listed twice \(also on line 2\)"),
    ],
)
def test_expert_list_csv_errors(tmp_path, text, match):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(UserError, match=match) as ei:
        load_expert_list(path, 3, 8, MOE)
    assert str(path) in str(ei.value)


def test_expert_list_uniform_check_via_check_keep_counts(tmp_path):
    j = _json_list(tmp_path, {**GOOD, "layers": {"3": {"remove": [1, 2]}}})
    kept = load_expert_list(j, 3, 8, MOE)
    with pytest.raises(UserError, match="different numbers of experts"):
        check_keep_counts(kept, 8, 2, moe_layer_indices=MOE)


# ------------------------------------------------------------------------------------------- reports
def test_safety_report_loading(tmp_path):
    p = tmp_path / "safety_report.json"
    p.write_text(json.dumps({"safety_critical": {"1": [0, 2], "5": [7]}, "hcdg": {"1": [0]}, "hrcg": {"1": [2]}}))
    assert load_report_experts(p, "safety", MOE, num_experts=8) == {0: {0, 2}, 2: {7}}
    p.write_text(json.dumps({"hcdg": {"1": [0], "3": [4]}, "hrcg": {"1": [2], "5": [1]}}))  # fallback: union
    assert load_report_experts(p, "safety", MOE) == {0: {0, 2}, 1: {4}, 2: {1}}
    p.write_text(json.dumps({"hcdg": {"0": [1]}}))
    assert load_report_experts(p, "safety") == {0: {1}}  # no moe_layer_indices: keys are positions


def test_domain_report_and_merge(tmp_path):
    d = tmp_path / "domain_report.json"
    d.write_text(json.dumps({"domain_name": "solidity", "domain_experts": {"3": [1, 5], "5": [0]}}))
    dom = load_report_experts(d, "domain", MOE)
    assert dom == {1: {1, 5}, 2: {0}}
    s = tmp_path / "safety_report.json"
    s.write_text(json.dumps({"safety_critical": {"1": [3], "3": [5, 6]}}))
    saf = load_report_experts(s, "safety", MOE)
    merged = merge_expert_sets(saf, dom, None)
    assert merged == {0: {3}, 1: {1, 5, 6}, 2: {0}}
    # used as protection: never removed
    S = np.zeros((3, 8))
    kept = select_experts(S, 4, top_k=2, protected=merged)
    for pos, ex in merged.items():
        assert ex <= set(kept[pos])


@pytest.mark.parametrize(
    "kind, content, match",
    [
        ("safety", None, "does not exist; create it with `mlx-fun safety-scan`"),
        ("domain", None, "does not exist; create it with `mlx-fun domain-scan`"),
        ("safety", "{oops", "is not valid JSON"),
        ("safety", "[]", "is not a safety report"),
        ("safety", '{"domain_experts": {}}', 'no "safety_critical"'),
        ("domain", '{"safety_critical": {}}', 'no "domain_experts"'),
        ("domain", '{"domain_experts": [1, 2]}', "must be an object"),
        ("domain", '{"domain_experts": {"2": [1]}}', "layer 2 is not an MoE layer"),
        ("domain", '{"domain_experts": {"1": 4}}', "must be a list"),
        ("safety", '{"safety_critical": {"1": [9]}}', "expert 9, expected 0..7"),
    ],
)
def test_report_errors(tmp_path, kind, content, match):
    p = tmp_path / "report.json"
    if content is not None:
        p.write_text(content)
    with pytest.raises(UserError, match=match):
        load_report_experts(p, kind, MOE, num_experts=8)


def test_no_warnings_emitted_by_selection():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        select_experts(np.zeros((1, 4)), 2, top_k=2)
