"""`mlx-fun quantize`: MoE-aware mixed precision through mlx-lm's quantize_model, loaded by plain mlx_lm.load."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from mlx_fun import jobs
from mlx_fun.adapters import get_adapter
from mlx_fun.errors import UserError
from mlx_fun.model.io import load_model
from mlx_fun.rewrite.quantize import QuantRecipe, classes
from mlx_fun.observe.saliency import SaliencyAccumulator
from mlx_fun.output.streaming import source_tensors

from .cli_helpers import run as run_cli

ROOT = Path(__file__).resolve().parents[1]


def kinds_of(model_dir: Path) -> dict[str, str]:
    """Every quantizable module of the float model → router / experts / dense (by the adapter)."""
    model, _, config = load_model(model_dir, lazy=True)
    adapter = get_adapter(model, config)
    owners, _ = classes(adapter)
    out = {}
    for path, m in model.named_modules():
        if hasattr(m, "to_quantized"):
            owner = next((p for p in owners if path == p or path.startswith(p + ".")), None)
            out[path] = owners.get(owner, "dense")
    return out


def module(model, path: str):
    return dict(model.named_modules())[path]


def expected_bytes(float_dir: Path, settings: dict[str, tuple[int, int, str] | None], kinds: dict[str, str]) -> int:
    """Bytes the recipe must take on disk: quantized weights at bits/8 per value plus their scales (and affine
    biases) per group, float tensors as they are."""
    src = source_tensors(float_dir)
    total = 0
    for name, t in src.items():
        mod, leaf = name.rsplit(".", 1)
        chosen = settings.get(kinds.get(mod)) if mod in kinds and leaf == "weight" else None
        n = int(np.prod(t.shape))
        if chosen is None or t.shape[-1] % chosen[1]:
            total += t.nbytes
            continue
        bits, gs, mode = chosen
        total += n * bits // 8
        if mode == "affine":
            total += 2 * (n // gs) * 4  # float32 scales and biases (the tiny models are float32)
        else:
            total += n // gs  # one uint8 scale a group (mxfp4 / nvfp4)
    return total


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_recipe_bits_router_and_size(tmp_path, make_model, model_type):
    src = make_model(model_type)
    res = jobs.quantize.run(model=src, output=tmp_path / "q", recipe=QuantRecipe(
        expert_bits=3, expert_group_size=32, dense_bits=6, dense_group_size=32))
    kinds = kinds_of(src)
    model, _ = mlx_lm.load(str(res.output))
    ref, _, _ = load_model(src)
    seen = {"router": 0, "experts": 0, "dense": 0}
    for path, kind in kinds.items():
        m = module(model, path)
        if kind == "router":  # kept in float: the very same weights
            assert not hasattr(m, "bits")
            assert mx.array_equal(m.weight, module(ref, path).weight).item()
        else:
            want = 3 if kind == "experts" else 6
            assert (m.bits, m.group_size, m.mode) == (want, 32, "affine"), path
        seen[kind] += 1
    # every class present (deepseek's router is a bare weight, not a module mlx-lm quantizes)
    assert seen["experts"] and seen["dense"] and (seen["router"] or model_type == "deepseek_v3")
    if model_type in ("qwen2_moe", "deepseek_v3"):  # shared experts are dense: 6-bit
        shared = [p for p in kinds if "shared" in p]
        assert shared and all(module(model, p).bits == 6 for p in shared)
    settings = {"experts": (3, 32, "affine"), "dense": (6, 32, "affine"), "router": None}
    on_disk = sum(t.nbytes for t in source_tensors(res.output).values())
    assert on_disk == expected_bytes(src, settings, kinds)
    index = json.loads((res.output / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == on_disk
    meta = json.loads((res.output / "quantize_metadata.json").read_text())
    assert meta["recipe"]["router"] == "float" and meta["recipe"]["experts"] == "3-bit affine g32"
    assert sum(meta["modules"]["experts"].values()) == seen["experts"]
    assert np.isfinite(np.array(model(mx.array([[3, 9, 27]])).astype(mx.float32))).all()


def test_router_8bit_and_mxfp4_experts(tmp_path, make_model):
    src = make_model("qwen3_moe")
    res = jobs.quantize.run(model=src, output=tmp_path / "q", recipe=QuantRecipe(
        expert_mode="mxfp4", expert_bits=None, dense_bits=8, router_bits=8))
    model, _ = mlx_lm.load(str(res.output))
    for path, kind in kinds_of(src).items():
        m = module(model, path)
        want = {"router": (8, 64, "affine"), "experts": (4, 32, "mxfp4"), "dense": (8, 64, "affine")}[kind]
        assert (m.bits, m.group_size, m.mode) == want, path
    assert res.bits_per_weight < 9


def test_saliency_gives_the_coldest_layers_fewer_bits(tmp_path, make_model):
    src = make_model("qwen3_moe", num_hidden_layers=4)
    model, _, config = load_model(src, lazy=True)
    adapter = get_adapter(model, config)
    acc = SaliencyAccumulator.for_adapter(adapter)
    rng = np.random.default_rng(0)
    acc.freq[...] = 100
    acc.reap_count[...] = 100
    acc.reap_sum[...] = rng.uniform(50, 60, acc.freq.shape) * np.array([[3.0], [1.0], [2.0], [0.5]])
    acc.total_tokens = 400
    sal = acc.save(tmp_path / "s.npz")
    res = jobs.quantize.run(model=src, output=tmp_path / "q", saliency=sal, recipe=QuantRecipe(
        expert_bits=4, expert_group_size=32, cold_layers=2, cold_bits=2))
    layers = adapter.moe_layers()
    assert list(res.cold_layer_scores) == [layers[3], layers[1]]  # coldest first
    loaded, _ = mlx_lm.load(str(res.output))
    for pos, layer in enumerate(layers):
        bits = loaded.model.layers[layer].mlp.switch_mlp.gate_proj.bits
        assert bits == (2 if pos in (1, 3) else 4), layer
    meta = json.loads((res.output / "quantize_metadata.json").read_text())
    assert meta["recipe"]["cold_layers"] == [layers[3], layers[1]] and meta["recipe"]["cold_experts"] == "2-bit affine g32"


def test_eval_reports_perplexity_against_the_float_original(tmp_path):
    src = ROOT / "data" / "tiny-moe"
    q = jobs.quantize.run(model=src, output=tmp_path / "q", recipe=QuantRecipe(expert_bits=3, dense_bits=4)).output
    r = jobs.eval.run(model=q, reference=src, dataset=[str(ROOT / "data" / "calibration_sample.jsonl")],
                      max_samples=8, max_tokens=128).results
    (row,) = r.values()
    assert row["ppl"] > row["ref_ppl"] > 1 and row["kl"] > 0 and 0 < row["top1_agreement"] < 1


def test_cli_prints_the_recipe(tmp_path):
    out = tmp_path / "q"
    r = run_cli("quantize", "--model", str(ROOT / "data" / "tiny-moe"), "--expert-bits", "3", "--output", str(out))
    assert r.exit_code == 0, r.output
    assert "router: 4 × float" in r.output and "experts: 8 × 3-bit affine g64" in r.output
    assert "stay in float" in r.output  # the 48-wide down projections (no affine group size divides 48)
    assert mlx_lm.load(str(out))


@pytest.mark.parametrize("kwargs,message", [
    ({"expert_mode": "mxfp4", "expert_bits": 3}, "mxfp4 stores 4 bits"),
    ({"expert_bits": 7}, "expert_bits= must be one of 2, 3, 4, 5, 6, 8"),
    ({"dense_group_size": 48}, "dense_group_size= must be one of 32, 64, 128"),
    ({"router_bits": 4}, "router_bits= must be 16"),
    ({"cold_layers": 1, "cold_bits": 2}, "add saliency="),
    ({"saliency": "nope.npz"}, "saliency= needs cold_layers="),
    ({"max_shard_size": "0"}, "max_shard_size= must be a positive size"),
])
def test_bad_inputs_write_nothing(tmp_path, make_model, kwargs, message):
    fields = {f.name for f in dataclasses.fields(QuantRecipe)}
    with pytest.raises(UserError, match=message):  # a recipe's own rules refuse it when it is built
        recipe = QuantRecipe(**{k: v for k, v in kwargs.items() if k in fields})
        jobs.quantize.run(model=make_model("qwen3_moe"), output=tmp_path / "q", recipe=recipe,
                          **{k: v for k, v in kwargs.items() if k not in fields})
    assert not (tmp_path / "q").exists()


def test_quantized_input_and_too_many_cold_layers_refused(tmp_path, make_model):
    with pytest.raises(UserError, match=r"is already quantized \(4-bit affine\); quantize starts from the float"):
        jobs.quantize.run(model=make_model("qwen3_moe", bits=4), output=tmp_path / "q")
    src = make_model("qwen3_moe")
    model, _, config = load_model(src, lazy=True)
    sal = SaliencyAccumulator.for_adapter(get_adapter(model, config)).save(tmp_path / "s.npz")
    with pytest.raises(UserError, match=r"cold_layers= must be 1\.\.2 \(this model has 2 MoE layers\)"):
        jobs.quantize.run(model=src, output=tmp_path / "q", saliency=sal,
                          recipe=QuantRecipe(cold_layers=5, cold_bits=2))
    assert not (tmp_path / "q").exists()
    r = run_cli("quantize", "--model", str(make_model("qwen3_moe", bits=4)), "--output", str(tmp_path / "q"))
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize("args,needles", [
    (["--expert-group-size", "0"], ["--expert-group-size must be one of 32, 64, 128 for affine", "got 0"]),
    (["--dense-group-size", "0"], ["--dense-group-size must be one of 32, 64, 128 for affine", "got 0"]),
    (["--expert-mode", "mxfp4", "--expert-group-size", "0"], ["--expert-group-size must be one of 32 for mxfp4"]),
    (["--dense-mode", "nvfp4", "--dense-group-size", "0"], ["--dense-group-size must be one of 16 for nvfp4"]),
    (["--expert-group-size", "7"], ["--expert-group-size", "got 7"]),
    (["--expert-group-size", "-64"], ["--expert-group-size", "got -64"]),
    (["--expert-bits", "0"], ["--expert-bits"]),
    (["--dense-bits", "0"], ["--dense-bits"]),
    (["--router-bits", "0"], ["--router-bits"]),
    (["--cold-bits", "0"], ["--cold-bits"]),
    # the cold layers take --expert-group-size: a size their mode refuses names that flag (not a --cold-group-size)
    (["--expert-group-size", "128", "--saliency", "s.npz", "--cold-layers", "1", "--cold-mode", "mxfp4"],
     ["--expert-group-size must be one of 32 for mxfp4", "got 128"]),
])
def test_a_zero_group_size_or_bits_is_refused_not_taken_for_the_default(tmp_path, make_model, args, needles):
    """Issue 29 row 18a: `--expert-group-size 0` silently became 64 (7 and -64 were refused). Every group-size and
    bits option refuses 0 in one line, exit 2, before anything is written."""
    from .cli_helpers import expect_error
    from .test_nothing_lost import hidden, tree

    src = make_model("qwen3_moe")
    model, _, config = load_model(src, lazy=True)
    SaliencyAccumulator.for_adapter(get_adapter(model, config)).save(tmp_path / "s.npz")
    before = tree(src)
    args = [str(tmp_path / a) if a == "s.npz" else a for a in args]
    expect_error(run_cli("quantize", "--model", str(src), "--output", str(tmp_path / "q"), *args), *needles)
    assert not (tmp_path / "q").exists() and hidden(tmp_path) == [] and tree(src) == before
    with pytest.raises(UserError, match=r"expert_group_size= must be one of 32, 64, 128 for affine .*got 0\."):
        jobs.quantize.run(model=src, output=tmp_path / "q", recipe=QuantRecipe(expert_group_size=0))


def test_a_mode_with_its_own_bits_needs_no_bits_and_blames_only_bits_given(tmp_path, make_model):
    """Issue 41 row 14: `--expert-mode mxfp8` alone said "drop --expert-bits 4", a flag the user never gave (the
    default was 4). Left out, the bits are the mode's own; given and different, the message names what was given."""
    from .cli_helpers import expect_error

    src = make_model("qwen3_moe")
    expect_error(run_cli("quantize", "--model", str(src), "--output", str(tmp_path / "q"), "--expert-mode", "mxfp8",
                         "--expert-bits", "4"), "mxfp8 stores 8 bits; drop --expert-bits 4")
    r = run_cli("quantize", "--model", str(src), "--output", str(tmp_path / "q"), "--expert-mode", "mxfp8",
                "--dense-mode", "mxfp4")
    assert r.exit_code == 0, r.output
    recipe = json.loads((tmp_path / "q" / "quantize_metadata.json").read_text())["recipe"]
    assert (recipe["experts"], recipe["dense"]) == ("mxfp8 g32", "mxfp4 g32")


@pytest.mark.parametrize("cold, needle", [(["--cold-bits", "8"], "more bits than"),
                                          (["--cold-bits", "4"], "the same setting as")])
def test_cold_layers_that_would_get_more_bits_or_nothing_new_are_refused(tmp_path, make_model, cold, needle):
    """Issue 41 row 12: `--cold-bits 8` with 4-bit experts gave the coldest (least salient) layers the most bits."""
    from .cli_helpers import expect_error

    src = make_model("qwen3_moe")
    model, _, config = load_model(src, lazy=True)
    sal = SaliencyAccumulator.for_adapter(get_adapter(model, config)).save(tmp_path / "s.npz")
    expect_error(run_cli("quantize", "--model", str(src), "--output", str(tmp_path / "q"), "--saliency", str(sal),
                         "--cold-layers", "1", *cold), f"--cold-bits {cold[1]} gives the coldest", needle,
                 "pass a --cold-bits below 4")
    assert not (tmp_path / "q").exists()
