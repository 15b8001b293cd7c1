"""Data-parallel collect under MLX's own launcher (ring backend on loopback) equals one process."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mlx_fun.observe.distributed import World, gather, my_share

from .cli_helpers import script, python_path

ROOT = Path(__file__).resolve().parents[1]
MODEL, DATA = ROOT / "data" / "tiny-moe", ROOT / "data" / "calibration_sample.jsonl"
# batch size 1 (the default): every sample's forward is then the same computation in both runs. With larger
# batches the ranks group samples differently, and float32 forwards of other batch shapes round differently
# (~1e-8 relative, as a different --batch-size in one process would)
ARGS = ["--model", str(MODEL), "--dataset", str(DATA), "--max-samples", "16", "--max-tokens", "160"]


def test_shares_partition_the_samples_by_tokens():
    rng = np.random.default_rng(0)
    samples = [list(range(int(n))) for n in rng.integers(5, 300, 101)]
    shares = [my_share(samples, World(r, 3, None)) for r in range(3)]
    ids = sorted(id(s) for share in shares for s in share)
    assert ids == sorted(id(s) for s in samples)  # every sample exactly once
    tokens = [sum(map(len, share)) for share in shares]
    assert max(tokens) - min(tokens) <= 300  # at most one sample's worth apart
    assert my_share(samples, World(0, 1, None)) == samples
    assert [r["a"].tolist() for r in gather({"a": np.ones(3)}, World(0, 1, None))] == [[1, 1, 1]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ranks on one host get OPENBLAS_NUM_THREADS = cores / ranks (mlx_fun.runtime.blas.local_ranks); both runs use one
# thread so that every float32 forward is the same computation
ENV = dict(os.environ, PYTHONPATH=python_path(), OPENBLAS_NUM_THREADS="1")


def launch(n: int, *cli: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """``mlx.launch --backend ring -n N -- python -m mlx_fun CLI…`` on loopback, bounded in time."""
    env = ENV
    cmd = [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()", "--backend", "ring",
           "-n", str(n), "--starting-port", str(_free_port()), "--", sys.executable, "-m", "mlx_fun", *cli]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_two_process_collect_writes_the_single_process_file(tmp_path):
    one, two = tmp_path / "one.npz", tmp_path / "out" / "two.npz"
    single = subprocess.run([sys.executable, "-m", "mlx_fun", "collect", *ARGS, "--output", str(one)],
                            env=ENV, capture_output=True, text=True, timeout=240)
    assert single.returncode == 0, single.stderr
    proc = launch(2, "collect", *ARGS, "--output", str(two))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("Wrote ") == 1  # rank 0 alone reports (and writes)
    assert "over 2 ranks" in proc.stderr
    assert sorted(p.name for p in two.parent.iterdir()) == ["two.npz"]  # no other rank's temp or lock
    a, b = np.load(one), np.load(two)
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        if k in ("freq", "reap_count", "total_tokens") or a[k].dtype.kind != "f":
            assert np.array_equal(a[k], b[k]), k  # counts and identity: exact
        else:
            assert np.allclose(a[k], b[k], rtol=1e-9, atol=0), k  # sums: float64 rounding order only
    assert int(a["total_tokens"]) > 500


def test_bad_output_fails_on_every_rank_without_hanging(tmp_path):
    proc = launch(2, "collect", *ARGS, "--output", str(MODEL), timeout=120)  # a hang would time out
    out = proc.stdout + proc.stderr
    assert "Error: --output " + str(MODEL) + " is the input given to --model" in out
    # the first rank to exit is reported with code 2 and mlx.launch stops the other (-15); which rank is first is a
    # race. (mlx.launch itself only warns and exits 0.)
    assert re.search(r"rank [01] exited with code 2", out), out


def test_ranks_on_one_host_share_its_cores(tmp_path):
    from mlx_fun.runtime.blas import local_ranks

    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"], ["10.255.255.1:5002"]]))
    assert local_ranks({"MLX_HOSTFILE": str(hostfile)}) == 2
    assert local_ranks({}) == 0
    hostfile.write_text("not json")
    assert local_ranks({"MLX_HOSTFILE": str(hostfile)}) == 0


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_two_rank_pipeline_sharded_collect_is_the_unsharded_file(tmp_path, make_model, family):
    """mlx-lm's pipeline split (sharded_load): rank 1 runs the first half of the layers, rank 0 the rest; each counts
    its own MoE layers and the sum is the single-process file, bit for bit. The bundled qwen3_moe (4 MoE layers),
    and a deepseek_v3 whose first layer is dense (3 MoE layers: an uneven split) on a seeded subset of samples."""
    if family == "qwen3_moe":
        args = ARGS
    else:
        model = make_model("deepseek_v3", n_group=1, topk_group=1, num_hidden_layers=4)
        args = ["--model", str(model), "--dataset", str(DATA), "--max-samples", "8", "--max-tokens", "64",
                "--seed", "3"]
    one, two = tmp_path / "one.npz", tmp_path / "two.npz"
    single = subprocess.run([sys.executable, "-m", "mlx_fun", "collect", *args, "--output", str(one)],
                            env=ENV, capture_output=True, text=True, timeout=240)
    assert single.returncode == 0, single.stderr
    proc = launch(2, "collect", *args, "--output", str(two), "--pipeline")
    assert proc.returncode == 0 and proc.stdout.count("Wrote ") == 1, proc.stdout + proc.stderr
    assert "over 2 ranks (layers split)" in proc.stderr
    a, b = np.load(one), np.load(two)
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        assert np.array_equal(a[k], b[k]), k
    assert (a["freq"].sum(axis=1) == a["top_k"] * a["total_tokens"]).all()  # every layer counted once
    assert np.isfinite(a["reap_sum"]).all()


def test_pipeline_needs_ranks_and_a_family_that_splits(tmp_path, make_model):
    from .cli_helpers import expect_error, run

    expect_error(run("collect", *ARGS, "--output", tmp_path / "x.npz", "--pipeline"),
                 "--pipeline splits the model's layers across the ranks of mlx.launch")
    assert not (tmp_path / "x.npz").exists()
    mixtral = make_model("mixtral")
    args = ["--model", str(mixtral), "--dataset", str(DATA), "--max-samples", "2", "--max-tokens", "32"]
    proc = launch(2, "collect", *args, "--output", str(tmp_path / "m.npz"), "--pipeline", timeout=120)
    assert "model_type 'mixtral' has no pipeline split in mlx-lm" in proc.stdout + proc.stderr
    assert not (tmp_path / "m.npz").exists()


def test_tensor_parallel_blocks_are_refused_with_the_alternative(qwen_model):
    from mlx_fun.model import moe_hook
    from mlx_fun.adapters import get_adapter
    from mlx_fun.errors import UserError
    from mlx_fun.model.io import load_model

    model, _, config = load_model(qwen_model)
    adapter = get_adapter(model, config)
    adapter.blocks()[0].sharding_group = object()  # what mlx-lm's shard() leaves on a tensor-parallel block
    with pytest.raises(UserError, match=r"tensor-parallel MoE blocks .* split the model by layers instead"):
        moe_hook.install(adapter, [])


@pytest.mark.parametrize("args, needle", [
    (["--build", "{"], "JSONDecodeError"),  # fails in the script's process, once its temp dir is made
    (["--model", "missing-model", "--samples", "2", "--tokens", "16", "--repeats", "1"], "failed: "),  # in a run
], ids=["bad --build", "a failing collect"])
def test_a_failed_bench_distributed_run_leaves_no_temporary_directory(tmp_path, args, needle):
    """scripts/benchmarks/bench_distributed.py makes its model, dataset and outputs in a temp dir: removed on every
    exit."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = dict(os.environ, TMPDIR=str(tmpdir))
    out = script("benchmarks.bench_distributed", *args, cwd=tmp_path, env=env, timeout=120)
    assert out.returncode != 0 and needle in out.stderr, out.stderr[-2000:]
    assert list(tmpdir.iterdir()) == []


def test_more_ranks_than_layers_are_refused_before_anything_loads(tmp_path, monkeypatch):
    """Issue 41 row 11: `mlx.launch -n 5 collect --pipeline` on a 4-layer model died on every rank (mlx-lm split
    the layers [1, 1, 1, 1, 0]). The job checks the ranks against the config first, on every rank alike; here a
    5-rank world is what `world()` answers, in-process, instead of launching five processes."""
    from mlx_fun.observe import distributed
    from mlx_fun import jobs
    from mlx_fun.observe.distributed import check_pipeline
    from mlx_fun.errors import UserError

    layers = json.loads((MODEL / "config.json").read_text())["num_hidden_layers"]
    check_pipeline({"num_hidden_layers": layers}, World(0, layers, None))  # one layer each: fine
    with pytest.raises(UserError, match=rf"^pipeline= gives every rank at least one decoder layer, and this model "
                                        rf"has {layers} for {layers + 1} ranks; launch at most {layers} "):
        check_pipeline({"num_hidden_layers": layers}, World(0, layers + 1, None))
    monkeypatch.setattr(distributed, "world", lambda: World(0, layers + 1, None))
    monkeypatch.setattr(distributed, "pipeline_load", lambda *a: pytest.fail("loaded before checking the ranks"))
    with pytest.raises(UserError, match=rf"has {layers} for {layers + 1} ranks"):
        jobs.collect.run(model=MODEL, dataset=DATA, output=tmp_path / "s.npz", pipeline=True)
    assert list(tmp_path.iterdir()) == []
