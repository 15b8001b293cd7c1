"""Streaming prune: tensor by tensor over (sharded) safetensors, identical to today's in-memory prune + save."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten

from .cli_helpers import python_path

from mlx_fun import jobs
from mlx_fun.errors import UserError
from mlx_fun.model.io import load_model
from mlx_fun.jobs.common import load_moe
from mlx_fun.rewrite.prune import prune_model
from mlx_fun.output.streaming import read_header, source_tensors

ROOT = Path(__file__).resolve().parents[1]


def reshard(src: Path, dst: Path, max_bytes: int) -> Path:
    """A copy of the mlx-lm directory ``src`` whose weights are split into shards of at most ``max_bytes``."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copyfile(f, dst / f.name)
    weights = {}
    for f in sorted(src.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    shards, size = [], 0
    for k in sorted(weights):
        if not shards or size + weights[k].nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = weights[k]
        size += weights[k].nbytes
    wmap = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(dst / name), shard, metadata={"format": "mlx"})
        wmap.update({k: name for k in shard})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return dst


def expert_list(path: Path, model_dir: Path) -> Path:
    """Keep every other expert (and the last) in every MoE layer: non-consecutive rows, several runs."""
    _, _, _, adapter = load_moe(model_dir, lazy=True)
    E = adapter.num_experts
    keep = sorted(set(range(0, E, 2)) | {E - 1})
    if adapter.groups:  # group-limited routers keep the same number per group
        size = E // adapter.groups[0]
        keep = [g * size + j for g in range(adapter.groups[0]) for j in range(size) if j % 2 == 0]
    layers = {str(layer): {"keep": keep} for layer in adapter.moe_layers()}
    path.write_text(json.dumps({"format": "mlx-fun-expert-list", "layers": layers}))
    return path


def in_memory_prune(model_dir: Path, keep_file: Path, out: Path) -> Path:
    """Today's prune before streaming: lazy load, slice the expert axis, mlx-lm's save_model."""
    from mlx_lm.utils import save_model

    from mlx_fun.experts.expert_files import load_expert_list

    model, _, config, adapter = load_moe(model_dir, lazy=True)
    keep = load_expert_list(keep_file, len(adapter.moe_layers()), adapter.num_experts, adapter.moe_layers())
    prune_model(adapter, keep)
    save_model(out, model)
    return out


def all_tensors(model_dir: Path) -> dict:
    out = {}
    for f in sorted(model_dir.glob("model*.safetensors")):
        out.update(mx.load(str(f)))
    return out


CASES = [("qwen3_moe", None, "affine"), ("qwen3_moe", 4, "affine"), ("qwen3_moe", None, "mxfp4"),
         ("gpt_oss", None, "affine"), ("gpt_oss", None, "mxfp4"), ("deepseek_v3", 4, "affine")]


@pytest.mark.parametrize("model_type,bits,mode", CASES, ids=lambda v: str(v))
def test_streaming_prune_equals_in_memory_prune(tmp_path, make_model, model_type, bits, mode):
    extra = {"n_group": 1, "topk_group": 1} if model_type == "deepseek_v3" else {}
    src = reshard(make_model(model_type, bits=bits, mode=mode, **extra), tmp_path / "src", 48 << 10)
    n_in = len(list(src.glob("model-*.safetensors")))
    assert n_in >= 3  # a sharded input
    keep = expert_list(tmp_path / "keep.json", src)
    ref = in_memory_prune(src, keep, tmp_path / "ref")
    res = jobs.prune.run(model=src, expert_list=keep, output=tmp_path / "out", max_shard_size="40KB")

    a, b = all_tensors(ref), all_tensors(res.output)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert mx.array_equal(a[k], b[k]).item(), k
    # nothing needed decoding: every byte is a copied tensor or copied expert rows
    assert res.bytes_evaluated == 0 and res.bytes_copied == sum(v.nbytes for v in b.values())
    # sharded output with mlx-lm's names and a correct index
    shards = sorted(p.name for p in res.output.glob("*.safetensors"))
    assert len(shards) == res.shards >= 2
    assert shards == [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    index = json.loads((res.output / "model.safetensors.index.json").read_text())
    located = {name: f for f in shards for name in read_header(res.output / f)[0] if name != "__metadata__"}
    assert index["weight_map"] == dict(sorted(located.items()))
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in b.values())
    ref_index = json.loads((ref / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_parameters"] == ref_index["metadata"]["total_parameters"]
    for f in shards:  # every shard within the limit unless one tensor alone is larger
        header, _ = read_header(res.output / f)
        sizes = [e - s for name, t in header.items() if name != "__metadata__" for s, e in [t["data_offsets"]]]
        assert sum(sizes) <= 40 << 10 or len(sizes) == 1
        assert header["__metadata__"] == {"format": "mlx"}
    model, _ = mlx_lm.load(str(res.output))  # plain mlx-lm loads it
    out = model(mx.array([[5, 17, 99]]))
    assert np.isfinite(np.array(out.astype(mx.float32))).all()


def open_files() -> int:
    return len(os.listdir("/proc/self/fd")) if Path("/proc/self/fd").is_dir() else 0


def test_default_is_one_shard_like_mlx_lm(tmp_path, qwen_model):
    keep = expert_list(tmp_path / "keep.json", qwen_model)
    before = open_files()
    res = jobs.prune.run(model=qwen_model, expert_list=keep, output=tmp_path / "out")
    assert open_files() <= before  # every source file opened for copying is closed again
    assert sorted(p.name for p in res.output.glob("*.safetensors")) == ["model.safetensors"]
    assert set(json.loads((res.output / "model.safetensors.index.json").read_text())["weight_map"].values()) == {
        "model.safetensors"}


def test_tensors_rebuilt_by_sanitize_are_evaluated_not_copied(tmp_path, make_model):
    """mixtral's sanitize stacks per-expert tensors: a checkpoint in that layout is rebuilt while loading, so the
    writer must evaluate those tensors, and the result still equals the in-memory prune."""
    src = make_model("mixtral")
    raw = tmp_path / "raw"
    shutil.copytree(src, raw)
    w = all_tensors(raw)
    for f in raw.glob("model*.safetensors"):
        f.unlink()
    (raw / "model.safetensors.index.json").unlink(missing_ok=True)
    unstacked = {}
    for k, v in w.items():
        if ".block_sparse_moe.switch_mlp." in k:
            stem, proj, leaf = k.rsplit(".", 2)
            hf = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}[proj]
            for e in range(v.shape[0]):
                unstacked[f"{stem.replace('switch_mlp', 'experts')}.{e}.{hf}.{leaf}"] = v[e]
        else:
            unstacked[k] = v
    mx.save_safetensors(str(raw / "model.safetensors"), unstacked)
    keep = expert_list(tmp_path / "keep.json", raw)
    ref = in_memory_prune(raw, keep, tmp_path / "ref")
    res = jobs.prune.run(model=raw, expert_list=keep, output=tmp_path / "out")
    a, b = all_tensors(ref), all_tensors(res.output)
    assert sorted(a) == sorted(b) and all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert res.bytes_evaluated > 0 and res.bytes_copied > 0  # experts rebuilt, attention copied


def test_bad_shard_size_exits_before_loading(tmp_path, qwen_model):
    keep = expert_list(tmp_path / "keep.json", qwen_model)
    for bad in ("0", "lots", "-5MB"):
        with pytest.raises(UserError, match=r"max_shard_size= must be a positive size such as 5GB"):
            jobs.prune.run(model=qwen_model, expert_list=keep, output=tmp_path / "out", max_shard_size=bad)
    assert not (tmp_path / "out").exists()


CHILD = """
import sys, time
import mlx_fun.output.streaming as s
real = s._write_shard
def slow(*a, **k):
    real(*a, **k)
    print("SHARD", flush=True)
    time.sleep(30)
s._write_shard = slow
from mlx_fun.cli import main
main(sys.argv[1:], prog_name="mlx-fun")
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_streaming_prune_leaves_nothing(tmp_path, make_model, sig):
    src = reshard(make_model("qwen3_moe", bits=4), tmp_path / "src", 48 << 10)
    keep = expert_list(tmp_path / "keep.json", src)
    out = tmp_path / "result" / "pruned"
    env = dict(os.environ, PYTHONPATH=python_path())
    proc = subprocess.Popen([sys.executable, "-c", CHILD, "prune", "--model", str(src), "--expert-list", str(keep),
                             "--output", str(out), "--max-shard-size", "40KB"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    line = ""
    while "SHARD" not in line and time.time() < deadline:
        line = proc.stdout.readline()
    assert "SHARD" in line  # one shard is written, more are to come
    proc.send_signal(sig)
    rc = proc.wait(timeout=60)
    assert rc == (130 if sig == signal.SIGINT else 128 + sig)
    assert not out.exists() and not (tmp_path / "result").exists()  # not even the parent it created


def test_source_tensors_reads_every_shard(tmp_path, make_model):
    src = reshard(make_model("qwen3_moe"), tmp_path / "src", 48 << 10)
    found = source_tensors(src)
    model, _, _ = load_model(src, lazy=True)
    params = dict(tree_flatten(model.parameters()))
    assert set(found) == set(params)
    assert all(found[k].shape == tuple(params[k].shape) for k in params)
