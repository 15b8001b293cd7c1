"""Issue 43: ``abliterate --stream-layers``: every forward with one decoder layer's weights in memory at a time, each
layer read again from the model's files (:class:`mlx_fun.model.layer_files.LayerFiles`), the same directions,
measurements and written weights as in memory, bit for bit (the per-family comparison runs in
``tests/test_abliterate.py::test_every_family_abliterates_and_reloads``, beside the in-memory run it compares with)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_fun import jobs
from mlx_fun.adapters import REGISTRY
from mlx_fun.model.io import load_model
from mlx_fun.model.layer_files import LayerFiles, per_call
from mlx_fun.model.layered import release_layer
from mlx_fun.rewrite.abliterate_options import Estimate, Evaluation, Projection

from .cli_helpers import KILLED_AFTER_SAVE, expect_error, full_and_lazy, python_path
from .cli_helpers import run as cli
from .conftest import FAMILIES

#: one model type of every routing family (adapter class): the ones whose streamed abliterate is compared
STREAMED_FAMILIES = set({REGISTRY[t]: t for t in reversed(FAMILIES)}.values()) - {"deepseek_v41"}


def _files(out: Path) -> dict[str, bytes]:
    """Every file of a written model but its card (which names the output's path)."""
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "README.md"}


def assert_streamed_equal(memory, streamed) -> None:
    """The streamed result (``stream_layers=True``) against the in-memory one: the same rounds, directions,
    measurements and written files (weights, index, metadata), bit for bit."""
    assert (memory.streamed, streamed.streamed) == (False, True)
    assert np.array_equal(streamed.directions, memory.directions)
    assert streamed.direction_norms == memory.direction_norms
    assert (streamed.before, streamed.after, streamed.trials) == (memory.before, memory.after, memory.trials)
    assert [r.row() for r in streamed.rounds] == [r.row() for r in memory.rounds]
    assert (streamed.layers, streamed.modified, streamed.warnings) == (memory.layers, memory.modified, memory.warnings)
    assert _files(streamed.output) == _files(memory.output)
    assert streamed.peak_bytes > 0


def _replies(path, prompts):
    """Greedy replies (and their first-token log-probs) of ``path`` in memory and, streamed, of a lazy copy whose
    layers were released: ``(in memory, streamed, the lazy copy's LayerFiles)``."""
    from mlx_fun.observe.refusal import greedy_replies

    model, adapter, lazy, ladapter = full_and_lazy(path)
    tok = load_model(path)[1]
    files = LayerFiles(lazy, ladapter, path)
    for layer in ladapter.decoder_layers():
        release_layer(layer)
    memory = greedy_replies(model, tok, prompts, 4, first_logprobs=True)
    with per_call(files):
        streamed = greedy_replies(lazy, tok, prompts, 4, first_logprobs=True)
    return memory, streamed, files, model, ladapter


PROMPTS = [[5, 9, 23, 31, 7], [40, 41, 42], [3, 3, 3, 100, 101, 102, 8]]


@pytest.mark.parametrize("family,bits", [(f, None) for f in FAMILIES] + [("qwen3_moe", 4), ("deepseek_v3", 4)])
def test_layers_read_again_from_the_files_reply_token_for_token(make_model, family, bits):
    """Every family: a released layer read again from the files is the loaded one (through mlx-lm's sanitize), and
    greedy replies with each layer loaded per call (mlx-lm's BatchGenerator: one pass over the layers per token)
    are the in-memory ones, with the same first-token log-probs; every layer is released afterwards."""
    memory, streamed, files, model, adapter = _replies(make_model(family, bits=bits), PROMPTS)
    assert streamed[0] == memory[0]
    if memory[1] is not None:
        assert np.array_equal(np.array(streamed[1]), np.array(memory[1]))
    for layer in adapter.decoder_layers():
        assert all(a.size == 0 for _, a in tree_flatten(layer.parameters()))
    for i in range(len(files.layers)):
        files.load(i)
    want, have = dict(tree_flatten(model.parameters())), dict(tree_flatten(files.model.parameters()))
    assert want.keys() == have.keys()
    for k in want:
        assert mx.array_equal(want[k], have[k]).item(), k


def _per_expert(src: Path, dst: Path) -> Path:
    """``src`` (a tiny qwen3_moe) rewritten as a per-expert checkpoint (``mlp.experts.<e>.<proj>.weight``, what
    Hugging Face ships and mlx-lm stacks while loading)."""
    import shutil

    shutil.copytree(src, dst)
    (dst / "model.safetensors.index.json").unlink()
    tensors = dict(mx.load(str(dst / "model.safetensors")))
    for name in [n for n in tensors if ".mlp.switch_mlp." in n]:
        stacked = tensors.pop(name)
        for e in range(stacked.shape[0]):
            tensors[name.replace(".switch_mlp.", f".experts.{e}.")] = stacked[e]
    mx.save_safetensors(str(dst / "model.safetensors"), tensors)
    return dst


def test_a_per_expert_checkpoint_is_stacked_again_and_abliterates_alike(make_model, tmp_path):
    from .test_abliterate import _prompts

    path = _per_expert(Path(make_model("qwen3_moe")), tmp_path / "per-expert")
    memory, streamed, files, _, _ = _replies(path, PROMPTS[:2])
    assert streamed[0] == memory[0] and not files.whole  # each layer sanitized from its own tensors (and layer 0's)
    harmful, benign = _prompts(tmp_path)
    how = dict(model=path, harmful_dataset=harmful, benign_dataset=benign, max_samples=3, seed=0,
               evaluation=Evaluation(eval_samples=2, reply_tokens=2), estimate=Estimate(refusal_filter=False))
    assert_streamed_equal(jobs.abliterate.run(output=tmp_path / "mem", stream_layers=False, **how),
                          jobs.abliterate.run(output=tmp_path / "streamed", stream_layers=True, **how))


@pytest.fixture(scope="module")
def searched(make_model, tmp_path_factory):
    """A search (2 settings, per-layer directions) of a tiny 4-bit qwen3_moe in memory and streamed, counting while
    streamed the other layers holding weights whenever a pass loads one (``held``) and the layers projected
    (``projected``)."""
    from .test_abliterate import _prompts

    root = tmp_path_factory.mktemp("abl-search")
    harmful, benign = _prompts(root)
    how = dict(model=make_model("qwen3_moe", bits=4), harmful_dataset=harmful, benign_dataset=benign, max_samples=3,
               seed=0, evaluation=Evaluation(search=2, max_kl=10.0, eval_samples=2, reply_tokens=2),
               estimate=Estimate(refusal_filter=False, direction="per-layer"), projection=Projection(layers="auto"))
    memory = jobs.abliterate.run(output=root / "mem", stream_layers=False, **how)
    held, load = [], LayerFiles.load

    def counting(self, i, **kw):
        held.append(sum(any(a.size for _, a in tree_flatten(layer.parameters()))
                        for j, layer in enumerate(self.layers) if j != i))
        load(self, i, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LayerFiles, "load", counting)
        projected = _count_projections(mp)
        streamed = jobs.abliterate.run(output=root / "out" / "streamed", stream_layers=True, **how)
    return SimpleNamespace(how=how, memory=memory, streamed=streamed, held=held, projected=projected)


def _count_projections(mp) -> list[int]:
    """The decoder layers :func:`mlx_fun.rewrite.abliterate.apply_layer` projects from here on, in order."""
    from mlx_fun.rewrite import abliterate

    calls, real = [], abliterate.apply_layer

    def counting(adapter, i, *a, **k):
        calls.append(i)
        return real(adapter, i, *a, **k)

    mp.setattr(abliterate, "apply_layer", counting)
    return calls


def test_the_search_streamed_holds_one_layer_at_a_time(searched):
    """A search (every candidate abliterated, measured and undone: kept layers forgotten and rewritten) gives the
    in-memory trials; whenever a pass loads a layer, every other layer is released (until the writer loads them
    all lazily), and nothing of its checkpoint (the kept layers) is left beside the output."""
    memory, streamed, held = searched.memory, searched.streamed, searched.held
    assert len(memory.trials) == 2 and streamed.trials == memory.trials
    assert_streamed_equal(memory, streamed)
    n = len(streamed.direction_norms)
    assert len(held) > 10 * n and not any(held[:-n]) and held[-n:] == list(range(n))
    assert os.listdir(streamed.output.parent) == ["streamed"]


KILLED = KILLED_AFTER_SAVE + """
from mlx_fun import jobs
from mlx_fun.rewrite.abliterate_options import Estimate, Evaluation, Projection
groups = dict(estimate=Estimate, projection=Projection, evaluation=Evaluation)
jobs.abliterate.run(**{k: groups[k](**v) if k in groups else v for k, v in json.loads(sys.argv[1]).items()})
"""


def test_a_killed_streamed_abliterate_resumes_after_its_last_phase(searched, tmp_path, monkeypatch):
    """SIGKILL after the search's first trial: the checkpoint holds round 1's statistics, the original model's
    measurement, the trial and the projection it measured; another benign dataset is refused in one line naming
    what differs; the rerun says where it resumes, runs none of the recorded phases again, reads the kept layers back
    instead of projecting them again, and writes the uninterrupted run's files; nothing stays behind."""
    from mlx_fun.errors import UserError

    how, whole = searched.how, searched.streamed
    out = tmp_path / "out" / "abl"
    child = {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v if isinstance(v, int) else str(v)
             for k, v in how.items()}
    killed = subprocess.run([sys.executable, "-c", KILLED, json.dumps(dict(child, output=str(out), stream_layers=True))],
                            env=dict(os.environ, PYTHONPATH=python_path(), KILL_AFTER="2"), capture_output=True, text=True,
                            timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    ckpt = out.parent / ".abl.stream"
    phases = json.loads((ckpt / "state.json").read_text())["data"]["phases"]
    assert [p["phase"] for p in phases] == ["round 1's statistics", "the original model's measurement",
                                            "search trial 1"] and not out.exists()
    assert len(list((ckpt / "projected-layers").glob("*.safetensors"))) == len(whole.trials[0].layers)
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Name a colour {i}."}]}) + "\n"
                             for i in range(6)))
    with pytest.raises(UserError, match=r"is of another streamed abliterate \(its benign_dataset, prompts_sha256 "
                                        r"differ from this run's\); rerun that command to resume it, or remove .*"):
        jobs.abliterate.run(**dict(how, benign_dataset=other), output=out, stream_layers=True)
    assert ckpt.is_dir() and not out.exists()
    lines = []
    projected = _count_projections(monkeypatch)
    resumed = jobs.abliterate.run(**how, output=out, stream_layers=True, log=lines.append)
    assert f"Resuming after search trial 1 (3 phases done) from {ckpt}." in lines
    assert not [line for line in lines if line.startswith(("Round 1", "Measuring the original"))]
    assert len(projected) == len(searched.projected) - len(whole.trials[0].layers)  # trial 1's read back
    assert _files(out) == _files(whole.output)
    assert_streamed_equal(searched.memory, resumed)
    assert os.listdir(out.parent) == ["abl"]  # the checkpoint is gone once the output is written


def test_interrupted_after_its_last_phase_it_resumes_to_writing(make_model, tmp_path, monkeypatch):
    """Ctrl-C after the final measurement (no search): the rerun replays every phase, makes no projection again
    (the final one's layers read back from the checkpoint for the writer) and writes the in-memory run's files."""
    from mlx_fun.observe.checkpoint import StreamCheckpoint

    from .test_abliterate import _prompts

    harmful, benign = _prompts(tmp_path)
    how = dict(model=make_model("qwen3_moe", bits=4), harmful_dataset=harmful, benign_dataset=benign, max_samples=3,
               seed=0, evaluation=Evaluation(eval_samples=2, reply_tokens=2),
               estimate=Estimate(refusal_filter=False, rounds=1))
    memory = jobs.abliterate.run(output=tmp_path / "mem", stream_layers=False, **how)
    real = StreamCheckpoint.save

    def interrupted(self, layer, *a, **k):
        real(self, layer, *a, **k)
        if json.loads((self.path / "state.json").read_text())["data"]["phases"][-1]["phase"].startswith("the abl"):
            raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StreamCheckpoint, "save", interrupted)
        with pytest.raises(KeyboardInterrupt):
            jobs.abliterate.run(output=tmp_path / "abl", stream_layers=True, **how)
    lines, projected = [], _count_projections(monkeypatch)
    resumed = jobs.abliterate.run(output=tmp_path / "abl", stream_layers=True, log=lines.append, **how)
    assert [line for line in lines if line.startswith("Resuming")] == [
        f"Resuming after the abliterated model's measurement (3 phases done) from {tmp_path / '.abl.stream'}."]
    assert projected == []
    assert_streamed_equal(memory, resumed)
    assert not (tmp_path / ".abl.stream").exists()


def test_the_command_streams_says_so_and_prints_its_peak(make_model, tmp_path, monkeypatch):
    from mlx_fun.runtime import memory

    from .test_abliterate import _prompts

    harmful, benign = _prompts(tmp_path)
    base = ["abliterate", "--model", make_model("qwen3_moe"), "--harmful-dataset", harmful, "--benign-dataset", benign,
            "--no-refusal-filter", "--max-samples", 2, "--eval-samples", 1, "--rounds", 1, "--seed", 0]
    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)  # the weights exceed the memory left
    result = cli(*base, "--output", tmp_path / "auto", "--dequant-cache", "64MiB")
    assert result.exit_code == 0, result.output
    assert "exceed the memory left" in result.output and "streaming the layers" in result.output
    assert "--dequant-cache is off while streaming" in result.output
    wrote = next(line for line in result.stdout.splitlines() if line.startswith("Wrote"))
    assert "peak memory" in wrote and "one decoder layer at a time" in wrote, wrote
    result = cli(*base, "--output", tmp_path / "mem", "--no-stream-layers")
    wrote = next(line for line in result.stdout.splitlines() if line.startswith("Wrote"))
    assert "peak memory" in wrote and "one decoder layer at a time" not in wrote, wrote
    assert _files(tmp_path / "auto") == _files(tmp_path / "mem")


def test_a_family_whose_layers_hand_state_on_is_refused_in_one_line(make_model, tmp_path):
    from .test_abliterate import _prompts

    harmful, benign = _prompts(tmp_path)
    out = tmp_path / "abl"
    expect_error(cli("abliterate", "--model", make_model("deepseek_v41"), "--harmful-dataset", harmful,
                     "--benign-dataset", benign, "--output", out, "--no-refusal-filter", "--stream-layers"),
                 "a streamed abliterate", "which deepseek_v41 does not allow", "without --stream-layers",
                 "--pipeline")
    assert not out.exists()


def test_the_help_says_what_streaming_rereads():
    text = cli("abliterate", "--help").output
    flat = " ".join(text.split())
    assert "--stream-layers / --no-stream-layers" in flat
    assert "per reply token of the greedy replies: reading every layer again per token is the price" in flat
    assert "a killed run resumes after its last finished phase" in flat and "hidden states are kept in files" not in flat

