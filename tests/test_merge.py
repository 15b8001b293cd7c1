"""REAM merging: grouping, alignment, merge == prune where it must be, every family float and quantized,
the layer-by-layer runner, cost linear in depth, and the `mlx-fun merge` command."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwitchLinear

from mlx_fun.model import layerwise
from mlx_fun.adapters import get_adapter
from mlx_fun.errors import UserError
from mlx_fun.model.io import load_model
from mlx_fun.output.model_dir import save_model_dir
from mlx_fun.rewrite.merge import group_experts, merge_model
from mlx_fun.rewrite.merge_align import align_permutation, alignment_cost
from mlx_fun.rewrite.prune import prune_model
from mlx_fun.rewrite.weights import dense as _dense
from mlx_fun.rewrite.weights import quantized_like as _quantize_expert
from mlx_fun.testing.tiny import build_model, tiny_config

from .conftest import FAMILIES
from .test_cli import SAMPLE
from .cli_helpers import expect_error as _error, run  # noqa: E402

RNG = np.random.default_rng(7)
SAMPLES = [RNG.integers(3, 500, n).tolist() for n in (20, 11)]
BATCH = [SAMPLES[0][:11], SAMPLES[1]]  # logits of both samples, cut to one length
def small(*, n_prune=None, batch_size=8, seed=0, **ream):
    """merge_model's groups for a small run (few similarity / alignment tokens, seed 0) with ``ream``'s fields."""
    from mlx_fun.datasets.calibration import Calibration
    from mlx_fun.experts.selection import Selection
    from mlx_fun.rewrite.merge_options import Ream

    ream = {"max_similarity_tokens": 24, "max_alignment_tokens": 16, **ream}
    return dict(selection=Selection(n_prune=n_prune), ream=Ream(**ream),
                calibration=Calibration(seed=seed, batch_size=batch_size))


NO_GROUPS = ("deepseek_v3", "deepseek_v32")  # 8 experts in 4 router groups cannot lose any: use n_group=1


def _logits(model, tokens=SAMPLES[:1]):
    out = model(mx.array(tokens))
    mx.eval(out)
    return np.array(out)


def _weights_bytes(path):
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _check_groups(meta, E, n_kept, max_group_size):
    for layer, groups in meta["group_map"].items():
        members = [e for g in groups.values() for e in g]
        assert sorted(members) == list(range(E)), f"layer {layer}: every expert exactly once"
        assert sorted(int(c) for c in groups) == meta["centroid_map"][layer] and len(groups) == n_kept
        assert all(g[0] == int(c) for c, g in groups.items())
        assert max(len(g) for g in groups.values()) <= max_group_size


# ---------------------------------------------------------------------------------------------- grouping
def test_grouping_never_exceeds_max_size_and_covers_every_expert_once():
    rng = np.random.default_rng(0)
    for trial in range(300):
        E = int(rng.integers(2, 40))
        k = int(rng.integers(1, E + 1))
        C = int(rng.integers(1, 8))
        sim = rng.normal(size=(E, E))
        sim = (sim + sim.T) / 2
        sal = rng.random(E)
        cents = sorted(rng.choice(E, k, replace=False).tolist())
        if k * C < E:  # no room for every expert: refused, never a group past C
            with pytest.raises(UserError, match=rf"max_group_size= {-(-E // k)} or more"):
                group_experts(sim, sal, cents, C)
            continue
        groups = group_experts(sim, sal, cents, C)
        members = [e for g in groups.values() for e in g]
        assert sorted(members) == list(range(E)) and sorted(groups) == cents
        assert all(g[0] == c for c, g in groups.items())
        assert max(len(g) for g in groups.values()) <= C
        # the most salient centroid claimed its most similar non-centroids first
        top = max(cents, key=lambda c: (sal[c], -c))
        others = [e for e in range(E) if e not in cents]
        want = sorted(others, key=lambda e: (-sim[top, e], e))[: C - 1]
        assert groups[top][1 : 1 + len(want)] == want


def test_max_group_size_is_never_exceeded():
    """Issue 29 row 18b: `--max-group-size 1` made groups of 5 (leftovers joined their most similar centroid).
    The maximum holds: a size with no room for every expert is refused."""
    sim = np.array([[1, 0, .9, .1], [0, 1, .2, .8], [.9, .2, 1, 0], [.1, .8, 0, 1]], dtype=float)  # fmt: skip
    with pytest.raises(UserError, match="^2 centroids × max_group_size= 1 hold 2 of the 4 experts per layer"):
        group_experts(sim, np.array([2.0, 1.0, 0, 0]), [0, 1], 1)
    assert group_experts(sim, np.array([2.0, 1.0, 0, 0]), [0, 1], 2) == {0: [0, 2], 1: [1, 3]}
    assert group_experts(sim, np.array([2.0, 1.0, 0, 0]), [0, 1], 16) == {0: [0, 2, 3], 1: [1]}


# ---------------------------------------------------------------------------------------------- alignment
@pytest.mark.parametrize("method", ["hungarian", "greedy"])
def test_alignment_recovers_a_neuron_permutation(method):
    rng = np.random.default_rng(1)
    I, D, N = 48, 16, 40
    gate, up, down = rng.normal(size=(I, D)), rng.normal(size=(I, D)), rng.normal(size=(D, I))
    x = rng.normal(size=(N, D))
    act = lambda g, u: (x @ g.T) / (1 + np.exp(-(x @ g.T))) * (x @ u.T)  # noqa: E731
    feats = lambda g, u, d: np.concatenate([g, u, d.T], axis=1)  # noqa: E731
    perm = rng.permutation(I)
    g2, u2, d2 = gate[perm], up[perm], down[:, perm]
    cost = alignment_cost(act(gate, up), act(g2, u2), feats(gate, up, down), feats(g2, u2, d2))
    found = align_permutation(cost, method)
    assert np.array_equal(g2[found], gate) and np.array_equal(d2[:, found], down)
    assert np.array_equal(align_permutation(cost, "none"), np.arange(I))
    assert sorted(align_permutation(rng.random((I, I)), method).tolist()) == list(range(I))


def _shuffled_copy_model(model_type, seed=0):
    """A float model in which expert 1 of every MoE layer is a neuron permutation of expert 0."""
    cfg = tiny_config(model_type)
    model = build_model(cfg, seed=seed)
    adapter = get_adapter(model, cfg)
    rng = np.random.default_rng(seed)
    for block in adapter.blocks():
        ex = adapter.experts(block)
        perm = mx.array(rng.permutation(ex.up_proj.weight.shape[1]).astype(np.int32))
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(ex, name)
            upd = {}
            for key in ("weight", "bias"):
                if key not in lin:
                    continue
                t = lin[key]
                if name == "down_proj":
                    src = t[0][:, perm] if key == "weight" else t[0]
                else:
                    src = t[0][perm]
                upd[key] = mx.concatenate([t[:1], src[None], t[2:]])
            lin.update(upd)
    mx.eval(model.parameters())
    return model, adapter, cfg


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("alignment", ["hungarian", "greedy", "none"])
def test_merging_a_shuffled_copy_gives_back_the_original(model_type, alignment):
    """Experts 0 and 1 compute the same function with permuted neurons; merging 1 into 0 must give expert 0 back
    (so the merged model equals the model pruned of expert 1) when the neurons are aligned — and not without."""
    model, adapter, cfg = _shuffled_copy_model(model_type)
    ref_model, ref_adapter, _ = _shuffled_copy_model(model_type)
    L, E = len(adapter.moe_layers()), adapter.num_experts
    keep = {p: [e for e in range(E) if e != 1] for p in range(L)}
    sal = np.tile(np.array([10.0, 5.0] + [1.0] * (E - 2)), (L, 1))
    meta = merge_model(model, adapter, SAMPLES, keep_map=keep, saliency=sal,
                       **small(alignment=alignment, max_group_size=2, saliency_source="file"))  # fmt: skip
    assert all(g["0"] == [0, 1] and all(len(m) == 1 for c, m in g.items() if c != "0")
               for g in meta["group_map"].values())  # fmt: skip
    prune_model(ref_adapter, keep)
    e0 = np.array(adapter.experts(adapter.blocks()[0]).down_proj.weight[0])
    r0 = np.array(ref_adapter.experts(ref_adapter.blocks()[0]).down_proj.weight[0])
    if alignment == "none":
        assert np.abs(e0 - r0).max() > 1e-3
    else:
        np.testing.assert_allclose(e0, r0, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(_logits(model, BATCH), _logits(ref_model, BATCH), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------- merge == prune
@pytest.mark.parametrize("model_type,bits", [("qwen3_moe", None), ("qwen3_moe", 4), ("gpt_oss", 4)])
def test_groups_of_one_equal_prune_bitwise(make_model, model_type, bits):
    src = make_model(model_type, bits=bits)
    model, _, config = load_model(src)
    adapter = get_adapter(model, config)
    L, E = len(adapter.moe_layers()), adapter.num_experts
    original = _logits(model, BATCH)

    # nothing to merge: every expert a centroid, groups of one, changes nothing
    meta = merge_model(model, adapter, SAMPLES, keep_map={p: list(range(E)) for p in range(L)},
                       saliency=np.ones((L, E)), **small(max_group_size=1, alignment="none",
                                                         saliency_source="file"))  # fmt: skip
    assert all(len(m) == 1 for g in meta["group_map"].values() for m in g.values())
    assert np.array_equal(_logits(model, BATCH), original)

    # members that carry no saliency leave every centroid alone: exactly prune, quantized or not
    keep = {p: [0, 2, 3, 5, 6, 7] for p in range(L)}
    sal = np.zeros((L, E))
    sal[:, keep[0]] = np.arange(1, 7)
    meta = merge_model(model, adapter, SAMPLES, keep_map=keep, saliency=sal,
                       **small(alignment="none", saliency_source="file"))
    assert sum(len(m) for m in meta["group_map"]["0"].values()) == E  # 1 and 4 did join a group
    pruned, _, pconfig = load_model(src)
    padapter = get_adapter(pruned, pconfig)
    assert prune_model(padapter, keep) == adapter.config
    assert np.array_equal(_logits(model, BATCH), _logits(pruned, BATCH))


# ---------------------------------------------------------------------------------------------- every family
def _src(make_model, model_type, bits, mode="affine"):
    if model_type in NO_GROUPS:
        return make_model(model_type, bits=bits, mode=mode, n_group=1, topk_group=1)
    return make_model(model_type, bits=bits, mode=mode)


CASES = [(mt, None, "affine") for mt in FAMILIES] + [(mt, 4, "affine") for mt in FAMILIES] + [
    ("qwen3_moe", None, "mxfp4"), ("gpt_oss", None, "mxfp4"), ("qwen3_moe", None, "nvfp4"),
]  # fmt: skip


@pytest.mark.parametrize("model_type,bits,mode", CASES, ids=lambda v: str(v))
def test_merged_model_loads_with_plain_mlx_lm_and_has_pruned_size(tmp_path, make_model, model_type, bits, mode):
    """Every family, float and 4-bit (and mxfp4 / nvfp4), with the default layerwise saliency (issue 45): the
    merged model loads with plain mlx-lm, has a pruned model's size and differs from it; merged streamed (issue 43)
    it is the same, bit for bit."""
    from .test_stream_merge import check_streamed_merge

    src = _src(make_model, model_type, bits, mode)
    model, _, config = load_model(src)
    adapter = get_adapter(model, config)
    E = adapter.num_experts
    how = small(n_prune=2, max_group_size=3)
    if adapter.layerwise_reason:  # layers that cannot be replayed one at a time: one line, nothing merged
        with pytest.raises(UserError, match=f"which {model_type} does not allow: .*; use prune"):
            merge_model(model, adapter, SAMPLES, **how)
        assert adapter.num_experts == E
        check_streamed_merge(src, how, tmp_path / "ckpt")  # refused too, naming --pipeline
        return
    meta = merge_model(model, adapter, SAMPLES, **how)
    check_streamed_merge(src, how, tmp_path / "ckpt", (model, adapter, meta))  # the same weights, bit for bit
    _check_groups(meta, E, E - 2, 3)
    assert meta["method"] == "ream" and meta["merged_num_experts"] == E - 2 == adapter.num_experts
    assert all(len(s) == E and min(s) > 0 for s in meta["saliency"].values())
    merged_logits = _logits(model)
    assert np.isfinite(merged_logits).all()
    out = save_model_dir(model, adapter.config, tmp_path / "merged", source=src,
                         metadata={"ream_metadata.json": meta})  # fmt: skip
    reloaded, _ = mlx_lm.load(str(out))
    assert np.array_equal(_logits(reloaded), merged_logits)

    keep = {p: meta["centroid_map"][str(layer)] for p, layer in enumerate(adapter.moe_layers())}
    pruned, _, pconfig = load_model(src)
    pconfig = prune_model(get_adapter(pruned, pconfig), keep)
    assert pconfig == adapter.config
    assert not np.array_equal(_logits(pruned), merged_logits)  # the merge did change experts
    pout = save_model_dir(pruned, pconfig, tmp_path / "pruned", source=src)
    assert _weights_bytes(out) == _weights_bytes(pout) > 0


@pytest.mark.parametrize("mode,group_size,bits,global_scale", [
    ("affine", 32, 4, False), ("affine", 64, 8, False), ("mxfp4", 32, 4, False), ("nvfp4", 16, 4, False),
    ("nvfp4", 16, 4, True),
])  # fmt: skip
def test_requantized_expert_keeps_the_format_and_the_values(mode, group_size, bits, global_scale):
    mx.random.seed(0)
    q = SwitchLinear(64, 32, 3, bias=False).to_quantized(group_size=group_size, bits=bits, mode=mode,
                                                         global_scale=global_scale)  # fmt: skip
    w = 0.5 * (_dense(q, 0) + _dense(q, 2))
    parts = _quantize_expert(q, w)
    assert set(parts) == {k for k in ("weight", "scales", "biases", "global_scale") if k in q}
    for k, v in parts.items():
        assert v.shape == q[k][0].shape and v.dtype == q[k].dtype, k
    q.update({k: mx.concatenate([q[k][:1], v[None], q[k][2:]]) for k, v in parts.items()})
    top = float(mx.abs(w).max())
    step = 2 * top / (2**bits - 1) if mode == "affine" else top / 3  # one affine step / fp4's widest gap (4 → 6)
    err = _dense(q, 1) - w
    assert float(mx.abs(err).max()) <= step
    assert float(mx.linalg.norm(err) / mx.linalg.norm(w)) < (0.02 if bits == 8 else 0.2)


# ---------------------------------------------------------------------------------------------- sequential
@pytest.mark.parametrize("model_type", FAMILIES)
def test_layer_by_layer_runner_equals_the_full_forward(model_type):
    cfg = tiny_config(model_type)
    model = build_model(cfg)
    adapter = get_adapter(model, cfg)
    layers = adapter.decoder_layers()
    # 24 tokens: longer than gpt-oss's sliding window (16) and the DSA indexer's top-k (4)
    tokens = mx.array(np.random.default_rng(0).integers(0, 500, (2, 24)))
    last, classes = {}, [type(layer) for layer in layers]
    if adapter.layerwise_reason:
        with pytest.raises(UserError, match="does not allow"):
            layerwise.run_layers(model, layers, tokens, adapter.layer_passthrough)
        return

    def grab(i):
        def fn(x, *a, **k):
            out = classes[i].__call__(layers[i], x, *a, **k)
            if i == len(layers) - 1:
                last["h"] = layerwise.hidden(out)
            return out

        return fn

    with layerwise.swap_layer_calls(layers, grab):
        ref = model(tokens)
    mx.eval(ref, last["h"])
    h = layerwise.run_layers(model, layers, tokens, adapter.layer_passthrough)
    assert np.array_equal(np.array(h), np.array(last["h"]))
    logits = layerwise.final_logits(model, layers, tokens, h, adapter.layer_passthrough)
    assert np.array_equal(np.array(logits), np.array(ref))


def test_merge_runs_each_layer_once_per_batch_plus_once_per_moe_layer():
    """Linear in depth: layer i is called once to capture its MoE input and once to propagate — never a forward
    of the whole model per merged layer."""
    cfg = tiny_config("deepseek_v3", n_group=1, topk_group=1, num_hidden_layers=4)
    model = build_model(cfg)
    adapter = get_adapter(model, cfg)
    layers = adapter.decoder_layers()
    calls = [0] * len(layers)
    for i, layer in enumerate(layers):
        cls = type(layer)

        def counted(self, *a, _i=i, _cls=cls, **k):
            calls[_i] += 1
            return _cls.__call__(self, *a, **k)

        layer.__class__ = type(f"Counted{i}", (cls,), {"__call__": counted})
    merge_model(model, adapter, SAMPLES,
                **small(n_prune=2, batch_size=1, max_similarity_tokens=100, max_alignment_tokens=8))  # fmt: skip
    n = len(SAMPLES)  # the layerwise saliency reads every token, so every batch runs the capture pass
    assert adapter.moe_layers() == [1, 2, 3]
    assert calls == [n, 2 * n, 2 * n, n]  # dense 0: propagate; MoE 1, 2: capture + propagate; last: capture only


# ---------------------------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def saliency_file(tmp_path_factory, make_model):
    out = tmp_path_factory.mktemp("merge") / "s.npz"
    model = make_model("qwen3_moe", bits=4)
    assert run("collect", "--model", model, "--dataset", SAMPLE, "--output", out, "--max-tokens", 32).exit_code == 0
    return model, out


def test_merge_cli_end_to_end(tmp_path, saliency_file):
    model, sal = saliency_file
    out = tmp_path / "merged"
    result = run("merge", "--model", model, "--saliency", sal, "--n-prune", 3, "--dataset", SAMPLE, "--output", out,
                 "--max-tokens", 32, "--max-samples", 6, "--max-similarity-tokens", 64, "--max-alignment-tokens", 32,
                 "--alignment", "greedy", "--max-group-size", 3, "--seed", 1)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "8 → 5" in result.output and "size on disk" in result.output and "Wrote" in result.output
    # the default saliency is measured during the merge (issue 45): the file given is not read, and one line says so
    assert (f"Warning: --saliency {sal} is not read: with --saliency-source layerwise (the default, REAM's own) "
            "each layer's saliency is measured during the merge; pass --saliency-source file") in result.output
    meta = json.loads((out / "ream_metadata.json").read_text())
    assert meta["method"] == "ream" and meta["original_num_experts"] == 8 and meta["merged_num_experts"] == 5
    assert meta["saliency_source"] == "layerwise" and meta["metric"].startswith("ream layerwise")
    assert all(c == sorted(np.argsort(-np.array(meta["saliency"][layer]), kind="stable")[:5].tolist())
               for layer, c in meta["centroid_map"].items())  # each layer's 5 most salient, as measured
    assert meta["alignment"] == "greedy" and meta["similarity_mode"] == "gated"
    _check_groups(meta, 8, 5, 3)
    assert json.loads((out / "config.json").read_text())["num_experts"] == 5
    reloaded, _ = mlx_lm.load(str(out))
    assert reloaded(mx.array([[1, 2, 3]])).shape == (1, 3, 512)

    lst = tmp_path / "list.json"
    lst.write_text(json.dumps({"format": "mlx-fun-expert-list", "layers": {"0": {"keep": [0, 1, 2, 3, 4, 5]},
                                                                           "1": {"remove": [6, 7]}}}))  # fmt: skip
    result = run("merge", "--model", model, "--expert-list", lst, "--dataset", SAMPLE, "--output", tmp_path / "b",
                 "--max-tokens", 16, "--max-samples", 4, "--similarity-mode", "average")  # fmt: skip
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "b" / "ream_metadata.json").read_text())
    assert meta["centroid_map"] == {"0": [0, 1, 2, 3, 4, 5], "1": [0, 1, 2, 3, 4, 5]}
    # the list fixes the centroids only: the layerwise saliency still weights the averages
    assert meta["similarity_mode"] == "average" and meta["metric"].startswith("ream layerwise")


def test_a_max_group_size_with_no_room_for_every_expert_is_refused(tmp_path, saliency_file):
    """Issue 29 row 18b: `merge --max-group-size 1` produced groups of 5 (the leftovers joined their most similar
    centroid past the maximum). Now one line naming the smallest size that works, exit 2, nothing written; that
    size then merges with no group past it."""
    from mlx_fun.errors import UserError
    from mlx_fun.jobs import merge as merge_job
    from mlx_fun.rewrite.merge_options import Ream
    from mlx_fun.experts.selection import Selection
    from mlx_fun.settings import RunSettings

    from .test_nothing_lost import hidden, tree

    model, sal = saliency_file
    before = tree(model)
    base = ("merge", "--model", model, "--saliency-source", "file", "--saliency", sal, "--n-prune", 3, "--dataset",
            SAMPLE, "--max-tokens", 16, "--max-samples", 4)
    _error(run(*base, "--output", tmp_path / "merged", "--max-group-size", 1),
           "5 centroids × --max-group-size 1 hold 5 of the 8 experts per layer, so 3 would fit in no group; pass "
           "--max-group-size 2 or more, or merge at most 0 experts per layer at this size")
    assert not (tmp_path / "merged").exists() and hidden(tmp_path) == [] and tree(model) == before
    got = run(*base, "--output", tmp_path / "merged", "--max-group-size", 2)
    assert got.exit_code == 0, got.output
    meta = json.loads((tmp_path / "merged" / "ream_metadata.json").read_text())
    _check_groups(meta, 8, 5, 2)
    from mlx_fun.observe.saliency import SaliencyAccumulator

    assert meta["saliency_source"] == "file" and meta["metric"] == "reap"  # the file's ranking, chosen up front
    np.testing.assert_allclose([meta["saliency"][k] for k in ("0", "1")],
                               SaliencyAccumulator.load(sal).ranking_scores("reap", over="experts"))
    for bad in (0, 1.5, True):
        with pytest.raises(UserError, match=rf"^max_group_size= must be a whole number of experts >= 1, got {bad}"):
            merge_job.run(model=model, saliency=sal, selection=Selection(n_prune=3), dataset=SAMPLE,
                          output=tmp_path / "py", ream=Ream(max_group_size=bad))
    _error(run(*base, "--output", tmp_path / "py", "--max-group-size", 0), "--max-group-size")
    assert not (tmp_path / "py").exists() and hidden(tmp_path) == [] and tree(model) == before
    # merge rewrites the experts a dequantized-experts cache would hold: a non-zero cache is refused in one line
    with pytest.raises(UserError, match=r"^merge takes no dequant_cache= \(got '1GiB'\): it rewrites the expert "):
        merge_job.run(model=model, saliency=sal, selection=Selection(n_prune=3), dataset=SAMPLE,
                      output=tmp_path / "py", settings=RunSettings(dequant_cache="1GiB"))
    assert not (tmp_path / "py").exists() and hidden(tmp_path) == [] and tree(model) == before


def test_merge_cli_errors(tmp_path, saliency_file, make_model):
    model, sal = saliency_file
    out = tmp_path / "out"
    base = ("merge", "--model", model, "--dataset", SAMPLE, "--output", out)
    _error(run(*base, "--saliency", sal, "--n-prune", 7), "top_k is 2")
    _error(run(*base), "give --n-prune (how many experts to merge away per layer) or --expert-list")
    _error(run(*base, "--n-prune", 1, "--model-wide"), "--model-wide ranks --saliency up front", "--saliency-source file")
    _error(run(*base, "--saliency-source", "file", "--n-prune", 1), "--saliency", "--expert-list")
    _error(run(*base, "--saliency-source", "file", "--saliency", sal), "needs --n-prune")
    _error(run(*base, "--saliency", tmp_path / "x.npz", "--n-prune", 1), "--saliency", "does not exist")
    _error(run("merge", "--model", model, "--dataset", tmp_path / "d.jsonl", "--output", out, "--saliency", sal,
               "--n-prune", 1), "--dataset", "does not exist")  # fmt: skip
    _error(run("merge", "--model", tmp_path / "nope", "--dataset", SAMPLE, "--output", out, "--saliency", sal,
               "--n-prune", 1), "does not exist")  # fmt: skip
    _error(run("merge", "--model", model, "--dataset", SAMPLE, "--output", model, "--saliency", sal,
               "--n-prune", 1), "is the input given to --model")  # fmt: skip
    _error(run(*base, "--saliency", sal, "--n-prune", 1, "--ignore-experts", "1"), "--model-wide")
    other = make_model("qwen3_moe", num_experts=16)
    _error(run("merge", "--model", other, "--dataset", SAMPLE, "--output", out, "--saliency", sal, "--n-prune", 1,
               "--saliency-source", "file"), "does not match")  # fmt: skip
    lst = tmp_path / "l.json"
    lst.write_text(json.dumps({"format": "mlx-fun-expert-list", "layers": {"0": {"remove": [1]}}}))
    _error(run(*base, "--expert-list", lst), "different numbers of experts")
    _error(run(*base, "--expert-list", lst, "--n-prune", 1), "drop --n-prune")
    assert not out.exists()


@pytest.mark.parametrize("model_type,overrides,match", [
    ("gemma4_text", {"num_kv_shared_layers": 1, "num_hidden_layers": 3,
                     "layer_types": ["sliding_attention", "full_attention", "full_attention"]}, "KV-shared layers"),
    ("hunyuan", {"use_cla": True}, "cross-layer attention"),
    ("kimi_k3", {"attn_res_block_size": 2}, "attention residuals"),
])  # fmt: skip
def test_merge_refuses_checkpoints_whose_layers_read_earlier_layers(model_type, overrides, match):
    """A layer-by-layer replay cannot give such layers what they read (earlier layers' K/V or outputs): merge
    refuses in one line instead of merging on wrong hidden states."""
    cfg = tiny_config(model_type, **overrides)
    model = build_model(cfg)
    adapter = get_adapter(model, cfg)
    with pytest.raises(UserError, match=f"{match}.*use prune"):
        merge_model(model, adapter, SAMPLES, **small(n_prune=2))
    assert adapter.num_experts == 8
