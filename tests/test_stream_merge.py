"""Issue 43: a layer-streamed merge (``merge --stream-layers``): one decoder layer's weights in memory at a time,
each merged layer written to the checkpoint and the output assembled from those files: the in-memory merge's
weights bit for bit, every family float and 4-bit (:func:`check_streamed_merge`, run by test_merge's every-family
test on its own in-memory merge); a killed run resumes at the next layer and writes what an uninterrupted run
writes; nothing stays behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten
from mlx_lm.utils import get_total_parameters

from mlx_fun.cli import main
from mlx_fun.errors import UserError, cli_names
from mlx_fun.observe.checkpoint import StreamCheckpoint
from mlx_fun.rewrite.merge import merge_model
from mlx_fun.runtime import memory

from .cli_helpers import CLI_MAIN, KILLED_AFTER_SAVE, python_path
from .test_merge import SAMPLES


def check_streamed_merge(src, how: dict, checkpoint_dir, memory=None) -> None:
    """A streamed merge of ``src`` (loaded lazily, one decoder layer at a time, each merged layer written to a
    checkpoint in ``checkpoint_dir``) gives the in-memory merge's weights bit for bit, its config and group map,
    and mlx-lm's parameter count; every visited layer is released. ``memory``: ``(model, adapter, metadata)`` of
    the in-memory merge of ``src`` with ``how`` (``merge_model``'s keywords). A family whose layers hand on state is
    refused in one line naming ``--pipeline``. test_merge's every-family test calls it on the in-memory merge it
    has made (every family, float and 4-bit, and mxfp4 / nvfp4), so no family is merged twice in memory."""
    from mlx_fun.adapters import get_adapter
    from mlx_fun.model.io import load_model

    lazy, _, config = load_model(src, lazy=True)
    ladapter = get_adapter(lazy, config)
    checkpoint = StreamCheckpoint(checkpoint_dir, {"model": str(src)}, job="merge")
    if ladapter.layerwise_blocker():
        with cli_names(), pytest.raises(UserError, match=f"^a streamed merge runs the model one decoder layer at a "
                                        f"time, which {ladapter.model_type} does not allow: .*; use prune .*--pipeline"):
            merge_model(lazy, ladapter, SAMPLES, checkpoint=checkpoint, **how)
        return
    model, adapter, memory_meta = memory
    streamed_meta = merge_model(lazy, ladapter, SAMPLES, checkpoint=checkpoint, **how)
    assert streamed_meta["group_map"] == memory_meta["group_map"]
    assert streamed_meta["centroid_map"] == memory_meta["centroid_map"] and ladapter.config == adapter.config
    parts = checkpoint.parts(ladapter.moe_layers()[-1])
    streamed = dict(tree_flatten(lazy.parameters()))
    released = {k for k, v in streamed.items() if v.size == 0}
    assert released == set(parts.tensors)  # every visited layer emptied, and each of its tensors in a part file
    for f in sorted({part.file for part in parts.tensors.values()}):
        streamed.update(mx.load(f))
    in_memory = dict(tree_flatten(model.parameters()))
    assert streamed.keys() == in_memory.keys()
    for name, arr in in_memory.items():
        assert streamed[name].dtype == arr.dtype and mx.array_equal(streamed[name], arr).item(), name
    assert get_total_parameters(lazy) + parts.parameters == get_total_parameters(model)


# ---------------------------------------------------------------------------------------------- the job
ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "calibration_sample.jsonl"
ARGS = ["--max-samples", "6", "--max-tokens", "48", "--seed", "1", "--batch-size", "2", "--max-similarity-tokens",
        "48", "--max-alignment-tokens", "24", "--max-group-size", "3"]
#: MoE layers 1-3 between a dense first layer (streamed too) and a dense last one (past the last MoE layer: never
#: run, written from the lazily loaded model)
LAYERS = {"num_hidden_layers": 5, "mlp_only_layers": [0, 4]}


def _merge_cli(model, experts, out, *extra, data=DATA):
    return CliRunner().invoke(main, ["merge", "--model", str(model), "--expert-list", str(experts), "--dataset",
                                     str(data), "--output", str(out), *ARGS, *extra])


def _weights(path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(Path(path).iterdir()) if "safetensors" in f.name}


@pytest.fixture(scope="module")
def merged(tmp_path_factory, make_model):
    """``(model, expert list, in-memory output, streamed output, the streamed run's text)``; the streamed run is
    the automatic choice (the memory left patched below the weights)."""
    model = make_model("qwen3_moe", bits=4, **LAYERS)
    root = tmp_path_factory.mktemp("stream-merge")
    experts = root / "experts.json"  # no saliency file: each layer's REAP from its captured tokens
    experts.write_text(json.dumps({"format": "mlx-fun-expert-list",
                                   "layers": {str(p): {"keep": [0, 2, 3, 5, 6, 7]} for p in (1, 2, 3)}}))
    mem = _merge_cli(model, experts, root / "mem", "--no-stream-layers")
    assert mem.exit_code == 0, mem.output
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(memory, "available_bytes", lambda: 1000)
        streamed = _merge_cli(model, experts, root / "auto" / "stream")
    assert streamed.exit_code == 0, streamed.output
    return model, experts, root / "mem", root / "auto" / "stream", streamed.output


def test_merge_stream_layers_writes_the_in_memory_model(merged):
    _model, _experts, mem, streamed, output = merged
    assert "exceed the memory left" in output and "streaming the layers" in output
    assert "peak memory" in output and "one decoder layer at a time" in output
    assert _weights(streamed) == _weights(mem)  # every shard byte for byte, and the index
    assert sorted(p.name for p in streamed.iterdir()) == sorted(p.name for p in mem.iterdir())
    assert (streamed / "config.json").read_text() == (mem / "config.json").read_text()
    a, b = (json.loads((d / "ream_metadata.json").read_text()) for d in (mem, streamed))
    assert a.keys() == b.keys() and a["layer_seconds"].keys() == b["layer_seconds"].keys() == {"1", "2", "3"}
    assert {k: v for k, v in a.items() if k not in ("layer_seconds", "seconds")} == \
           {k: v for k, v in b.items() if k not in ("layer_seconds", "seconds")}
    assert os.listdir(streamed.parent) == ["stream"]  # the checkpoint is gone once the output is written


CHILD = KILLED_AFTER_SAVE + CLI_MAIN


def test_a_killed_streamed_merge_resumes_at_the_next_layer(tmp_path, merged):
    model, experts, _mem, whole, _output = merged
    out = tmp_path / "out" / "m"
    env = dict(os.environ, PYTHONPATH=python_path(), KILL_AFTER="1")
    killed = subprocess.run([sys.executable, "-c", CHILD, "merge", "--model", str(model), "--expert-list",
                             str(experts), "--dataset", str(DATA), "--output", str(out), "--stream-layers", *ARGS],
                            env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    ckpt = tmp_path / "out" / ".m.stream"
    assert not out.exists() and json.loads((ckpt / "state.json").read_text())["layer"] == 1
    assert {p.name for p in ckpt.glob("layer-*")} == {"layer-0.safetensors", "layer-1.safetensors"}
    other = tmp_path / "other.jsonl"  # another dataset: refused in one line, the checkpoint kept
    other.write_text("".join(json.dumps({"content": f"other text {i} " * 9}) + "\n" for i in range(6)))
    refused = _merge_cli(model, experts, out, "--stream-layers", data=other)
    assert refused.exit_code == 2 and "is of another streamed merge" in refused.output, refused.output
    assert "dataset" in refused.output and "samples_sha256" in refused.output and ckpt.exists()
    resumed = _merge_cli(model, experts, out, "--stream-layers")
    assert resumed.exit_code == 0, resumed.output
    assert "Resuming at layer 2 of 4" in resumed.output
    assert _weights(out) == _weights(whole)
    assert sorted(p.name for p in out.parent.iterdir()) == ["m"]  # nothing of the checkpoint stays behind
