"""Issue 43: a layer-streamed collect (``collect --stream-layers``): one decoder layer's weights in memory at a
time, the in-memory collect's statistics (counts exactly, sums to float rounding), every family; a killed run
resumes at the next layer and writes what an uninterrupted run writes."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_fun.adapters import get_adapter
from mlx_fun.core.sizes import format_bytes
from mlx_fun.errors import UserError, cli_names
from mlx_fun.jobs.common import StreamPlan
from mlx_fun.observe.collect import collect, collect_streamed
from mlx_fun.observe.saliency import ARRAY_KEYS

from .cli_helpers import CLI_MAIN, KILLED_AFTER_SAVE, full_and_lazy, python_path
from .conftest import FAMILIES

SAMPLES = [list(range(5, 21)), list(range(40, 52))]  # 2 samples of 16 and 12 tokens: one padded batch
#: families whose streamed collect is also run with its hidden states spilled to files: plain layers, alternating
#: sliding-window masks, an array mask with latent attention, tuple-returning layers, linear-attention layers
SPILLED = ("qwen3_moe", "gpt_oss", "deepseek_v3", "gemma4", "qwen3_next")


def _pair(path, model_type, spill=None):
    """The in-memory statistics of a fully loaded model and the streamed ones of a lazily loaded copy; with
    ``spill``, also the streamed ones of the full model (released as it goes) with its hidden states spilled there."""
    model, adapter, lazy, ladapter = full_and_lazy(path)
    if ladapter.layerwise_blocker():
        with cli_names(), pytest.raises(UserError, match=f"which {model_type} does not allow: .*without "
                                                         "--stream-layers.*--pipeline under mlx.launch"):
            collect_streamed(lazy, ladapter, SAMPLES, batch_size=2)
        return None, None, None, None
    full = collect(model, adapter, SAMPLES, batch_size=2)
    streamed = collect_streamed(lazy, ladapter, SAMPLES, batch_size=2)
    spilled = None if spill is None else collect_streamed(model, adapter, SAMPLES, batch_size=2, spill=spill)
    return full, streamed, spilled, ladapter


def _identical(a, b) -> None:
    assert a.total_tokens == b.total_tokens
    for key in ("freq", "reap_count", *ARRAY_KEYS):
        assert np.array_equal(getattr(a, key), getattr(b, key)), key


@pytest.mark.parametrize("bits", [None, 4], ids=["float", "q4"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_streamed_collect_equals_the_in_memory_collect(make_model, model_type, bits, tmp_path):
    kw = {"n_group": 1, "topk_group": 1} if model_type in ("deepseek_v3", "deepseek_v32") else {}
    spill = tmp_path / "spill" if model_type in SPILLED else None
    full, streamed, spilled, adapter = _pair(make_model(model_type, bits=bits, **kw), model_type, spill)
    if full is None:
        return
    if spill is not None:  # the hidden states round-tripped through files in their own dtype: bit for bit
        _identical(spilled, streamed)
        assert not spill.exists()
    assert streamed.total_tokens == full.total_tokens == 28
    assert np.array_equal(streamed.freq, full.freq)
    assert np.array_equal(streamed.reap_count, full.reap_count)
    for key in ARRAY_KEYS:
        np.testing.assert_allclose(getattr(streamed, key), getattr(full, key), rtol=1e-5, atol=1e-6, err_msg=key)
    # every visited layer was released: nothing of its weights is left
    from mlx.utils import tree_flatten

    for i, layer in enumerate(adapter.decoder_layers()[: adapter.moe_layers()[-1] + 1]):
        assert all(a.size == 0 for _, a in tree_flatten(layer.parameters())), i


# ---------------------------------------------------------------------------------------------- the job
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import zipfile  # noqa: E402
from pathlib import Path  # noqa: E402

from click.testing import CliRunner  # noqa: E402

from mlx_fun import jobs  # noqa: E402
from mlx_fun.cli import main  # noqa: E402
from mlx_fun.runtime import memory  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "calibration_sample.jsonl"
ARGS = ["--max-samples", "6", "--max-tokens", "48", "--seed", "1", "--batch-size", "2"]


def _npz_members(path) -> dict[str, bytes]:
    """Every array file of an .npz, byte for byte (the zip's own timestamps aside)."""
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def _collect_cli(model, out, *extra):
    return CliRunner().invoke(main, ["collect", "--model", str(model), "--dataset", str(DATA), "--output",
                                     str(out), *ARGS, *extra])


def test_collect_stream_layers_writes_the_in_memory_statistics(tmp_path, make_model):
    model = make_model("gpt_oss", bits=4)
    for name, flag in (("mem", "--no-stream-layers"), ("stream", "--stream-layers")):
        result = _collect_cli(model, tmp_path / f"{name}.npz", flag)
        assert result.exit_code == 0, result.output
        line = next(ln for ln in result.stdout.splitlines() if ln.startswith("Wrote"))
        assert "peak memory" in line and ("one decoder layer at a time" in line) == (name == "stream"), line
    a, b = np.load(tmp_path / "mem.npz"), np.load(tmp_path / "stream.npz")
    assert sorted(a.files) == sorted(b.files)
    for key in a.files:
        if key in ("freq", "reap_count") or a[key].dtype.kind != "f":
            assert np.array_equal(a[key], b[key]), key
        else:
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert not (tmp_path / ".stream.npz.stream").exists()  # the checkpoint is gone once the output is written


def test_stream_layers_and_pipeline_are_refused_together(tmp_path, qwen_model):
    result = _collect_cli(qwen_model, tmp_path / "o.npz", "--stream-layers", "--pipeline")
    assert result.exit_code == 2 and "--stream-layers and --pipeline" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "o.npz").exists()


def test_streams_by_itself_when_the_weights_exceed_the_memory_left(tmp_path, qwen_model, monkeypatch):
    lines = []
    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)  # too little for a layer: the states spill too
    a = jobs.collect.run(model=qwen_model, dataset=DATA, output=tmp_path / "a.npz", max_samples=2, log=lines.append)
    assert any("exceed the memory left" in line and "streaming the layers" in line and "spilling them" in line
               for line in lines), lines
    assert a.streamed and a.spilled and sorted(p.name for p in tmp_path.iterdir()) == ["a.npz"]
    lines.clear()
    monkeypatch.setattr(memory, "available_bytes", lambda: 1 << 40)
    jobs.collect.run(model=qwen_model, dataset=DATA, output=tmp_path / "b.npz", max_samples=2, log=lines.append)
    assert not any("streaming" in line for line in lines)


def test_the_automatic_choice_reads_the_configs_reason_not_to_stream(tmp_path, make_model, monkeypatch):
    """hunyuan streams, but not with cross-layer attention (``use_cla``, a config option): the automatic choice
    reads it from the config, before loading, and runs in memory with a note instead of streaming into a refusal."""
    import json

    from mlx_fun.adapters import REGISTRY
    from mlx_fun.jobs.common import stream_choice

    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)
    path = Path(make_model("hunyuan"))
    config = json.loads((path / "config.json").read_text())
    lines = []
    assert stream_choice(None, [(path, REGISTRY["hunyuan"], config)], doing="collecting", log=lines.append,
                         tokens=1).layers is True
    cla = tmp_path / "cla"
    cla.mkdir()
    (cla / "config.json").write_text(json.dumps({**config, "use_cla": True}))
    (cla / "model.safetensors").write_bytes(b"\0" * 2000)  # weights over the (patched) memory left
    lines.clear()
    assert stream_choice(None, [(cla, REGISTRY["hunyuan"], {**config, "use_cla": True})], doing="collecting",
                         log=lines.append, tokens=1) == StreamPlan(False)
    assert len(lines) == 1 and "cross-layer attention (use_cla)" in lines[0] and "collecting in memory" in lines[0]


def test_the_automatic_choice_spills_the_hidden_states_that_do_not_fit_beside_one_layer(qwen_model, monkeypatch):
    """Streamed, the hidden states (tokens × hidden size × the model's dtype) and the largest layer are weighed
    against the memory left; the note says when they spill. A forced stream spills alike, with its own note."""
    from mlx_fun.adapters import REGISTRY
    from mlx_fun.jobs.common import STREAM_HEADROOM, stream_choice
    from mlx_fun.output.streaming import source_tensors

    config = json.loads((qwen_model / "config.json").read_text())
    models = [(qwen_model, REGISTRY["qwen3_moe"], config)]
    layer = sum(t.nbytes for name, t in source_tensors(qwen_model).items() if name.startswith("model.layers.0."))
    per_token = config["hidden_size"] * 4  # float32
    room = layer + 100 * per_token + STREAM_HEADROOM  # a layer, 100 tokens' hidden states and the run itself
    monkeypatch.setattr(memory, "weight_bytes", lambda _path: room + 1)  # the weights do not fit: streams
    monkeypatch.setattr(memory, "available_bytes", lambda: room)
    for tokens, spills in ((100, False), (101, True)):
        lines = []
        assert stream_choice(None, models, doing="collecting", log=lines.append, tokens=tokens) == StreamPlan(True, spills)
        assert len(lines) == 1 and "streaming the layers" in lines[0]
        assert ("spilling them to files on disk" in lines[0]) == spills, lines
    lines = []
    assert stream_choice(True, models, doing="collecting", log=lines.append, tokens=101) == StreamPlan(True, True)
    assert lines == [f"Note: the samples' hidden states (up to {format_bytes(101 * per_token)}) do not fit beside one "
                     f"layer ({format_bytes(layer)}) and {format_bytes(STREAM_HEADROOM)} for the run itself in the memory left "
                     f"({format_bytes(room)}): spilling them to files on disk."]
    assert stream_choice(False, models, doing="collecting", log=lines.append, tokens=10**9) == StreamPlan(False)


def test_a_spilled_collect_links_its_checkpoint_resumes_and_leaves_no_files(tmp_path, make_model):
    """Spilling, each batch alternates between two files; the checkpoint hard-links them (no second copy); a run
    that fails removes its spill directory, and the rerun resumes from the checkpoint with the statistics of an
    uninterrupted run, bit for bit."""
    from mlx_fun.model.io import load_model
    from mlx_fun.observe.checkpoint import StreamCheckpoint

    path = make_model("qwen3_moe", num_hidden_layers=4)

    def lazy():
        model, _, config = load_model(path, lazy=True)
        return model, get_adapter(model, config)

    whole = collect_streamed(*lazy(), SAMPLES, batch_size=1)
    spill, ckpt = tmp_path / "spill", StreamCheckpoint(tmp_path / "ckpt", {"run": 1})
    seen = {}

    def save(layer, states, acc):  # the real save, then a failure
        StreamCheckpoint.save(ckpt, layer, states, acc)
        seen["files"] = sorted(p.name for p in spill.iterdir())
        seen["linked"] = [os.path.samefile(f, ckpt.path / f"hidden-{layer}" / f"{n}.safetensors")
                          for n, f in states.items()]
        raise KeyboardInterrupt

    ckpt.save = save
    with pytest.raises(KeyboardInterrupt):
        collect_streamed(*lazy(), SAMPLES, batch_size=1, spill=spill, checkpoint=ckpt)
    assert seen == {"files": ["b0.0.safetensors", "b0.1.safetensors", "b1.0.safetensors", "b1.1.safetensors"],
                    "linked": [True, True]}
    assert not spill.exists() and json.loads((ckpt.path / "state.json").read_text())["layer"] == 0
    del ckpt.save
    lines = []
    resumed = collect_streamed(*lazy(), SAMPLES, batch_size=1, spill=spill, checkpoint=ckpt, log=lines.append)
    assert lines == [f"Resuming at layer 1 of 4 from {ckpt.path}."]
    _identical(resumed, whole)
    assert not spill.exists()


def test_memory_left_reads_meminfo_and_the_cgroup(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\nMemAvailable:     2048 kB\n")
    assert memory.meminfo_available(tmp_path / "meminfo") == 2048 * 1024
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("10\n")
    unknown = tmp_path / "no-proc-cgroup"  # where /proc/self/cgroup cannot be read: the root's own files
    assert memory.cgroup_room(tmp_path, unknown) is None  # no limit
    (tmp_path / "memory.max").write_text("1000\n")
    assert memory.cgroup_room(tmp_path, unknown) == 990


def test_the_cgroup_limit_is_read_where_this_process_sits(tmp_path):
    """A process in a nested cgroup (a systemd slice, cgexec, the benchmark's own memory cgroup) sees the root's
    files unlimited: its own cgroup and every parent up the path count (v1 and v2)."""
    v1 = tmp_path / "v1"
    for sub, cap, used in (("memory", 1 << 62, 0), ("memory/a", 5000, 100), ("memory/a/b", 3000, 1000)):
        (v1 / sub).mkdir(parents=True)
        (v1 / sub / "memory.limit_in_bytes").write_text(f"{cap}\n")
        (v1 / sub / "memory.usage_in_bytes").write_text(f"{used}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("7:cpu,cpuacct:/x\n5:memory:/a/b\n0::/user.slice\n")
    assert memory.cgroup_room(v1, proc) == 2000  # b's room; a's 4900 is more
    (v1 / "memory/a/memory.limit_in_bytes").write_text("1100\n")
    assert memory.cgroup_room(v1, proc) == 1000  # now the parent's is the least
    v2 = tmp_path / "v2"
    (v2 / "work").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("cpu memory\n")
    (v2 / "work" / "memory.max").write_text("800\n")
    (v2 / "work" / "memory.current").write_text("300\n")
    proc.write_text("0::/work\n")
    assert memory.cgroup_room(v2, proc) == 500
    proc.write_text("")
    assert memory.cgroup_room(v2, proc) is None  # the root's own files only: none here


# ---------------------------------------------------------------------------------------------- resume
CHILD = KILLED_AFTER_SAVE + CLI_MAIN


def _child(model, out, data=DATA, kill_after=-1, room=""):
    env = dict(os.environ, PYTHONPATH=python_path(), KILL_AFTER=str(kill_after), ROOM=str(room))
    return subprocess.run([sys.executable, "-c", CHILD, "collect", "--model", str(model), "--dataset", str(data),
                           "--output", str(out), "--stream-layers", *ARGS], env=env, capture_output=True, text=True,
                          timeout=300)


def test_a_killed_streamed_collect_resumes_at_the_next_layer(tmp_path, make_model):
    """The killed run spills its hidden states (too little memory left, patched): its spill directory is swept by
    the next run writing the output, and its checkpoint (the spilled files hard-linked) resumes a run that carries
    them in memory (and checkpoints them from memory)."""
    model = make_model("qwen3_moe", num_hidden_layers=4)
    whole = _child(model, tmp_path / "whole.npz")
    assert whole.returncode == 0, whole.stderr
    out = tmp_path / "out" / "o.npz"
    killed = _child(model, out, kill_after=1, room=1000)
    assert killed.returncode == -signal.SIGKILL and "spilling them to files on disk" in killed.stderr
    ckpt = tmp_path / "out" / ".o.npz.stream"
    assert not out.exists() and json.loads((ckpt / "state.json").read_text())["layer"] == 1
    [left] = out.parent.glob(".o.npz.*.spill")  # SIGKILL: nothing could remove it
    other = tmp_path / "other.jsonl"  # another dataset: refused, the checkpoint kept
    other.write_text("".join(json.dumps({"content": f"other text {i} " * 9}) + "\n" for i in range(6)))
    refused = _child(model, out, data=other)
    assert refused.returncode == 2 and "is of another streamed collect" in refused.stderr
    assert "dataset" in refused.stderr and "samples_sha256" in refused.stderr and ckpt.exists()
    assert f"Removed {left}, left behind by an interrupted run." in refused.stderr and not left.exists()
    resumed = _child(model, out)
    assert resumed.returncode == 0, resumed.stderr
    assert "Resuming at layer 2 of 4" in resumed.stdout + resumed.stderr
    assert _npz_members(out) == _npz_members(tmp_path / "whole.npz")
    assert not ckpt.exists() and sorted(p.name for p in out.parent.iterdir()) == ["o.npz"]


def test_checkpoint_policy_saves_when_the_work_since_the_last_save_took_ten_saves(tmp_path):
    """A save after the first layer, then only once the work since the last save took EVERY times that save: a
    quick layer beside a slow save is not saved after, a slow one is."""
    import mlx.core as mx

    from mlx_fun.observe import checkpoint as ck
    from mlx_fun.observe.saliency import SaliencyAccumulator

    clock = iter([0.0, 2.0, 2.5, 21.9, 22.0, 24.0, 30.0])  # save 0 takes 2 s; then 0.5 s, 19.9 s, 20 s of work
    cp = ck.StreamCheckpoint(tmp_path / "c", {"run": 1})
    cp.clock = lambda: next(clock)
    acc = SaliencyAccumulator(num_layers=1, num_experts=2, top_k=1)
    assert cp.due()
    cp.save(0, {"b0": mx.zeros((1, 2))}, acc)  # 0.0 → 2.0
    assert not cp.due()  # 2.5: 0.5 s of work < 10 × 2 s
    assert not cp.due()  # 21.9: 19.9 s
    assert cp.due()  # 22.0: 20 s
    cp.save(1, {"b0": mx.ones((1, 2))}, acc)  # 24.0 → 30.0: this save took 6 s
    assert cp.load().layer == 1
