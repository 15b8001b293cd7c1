"""Nothing lost, ever: every bad input a user can give to a writing command, with the exact command, exit code,
one-line message and the file system afterwards (input intact, no temp left, no partial output).

Rows follow the issue: 1 outputs that contain an input, 2 saliency files of another model, 3 unwritable / full /
failing output locations, 4 interrupted and concurrent runs, 5 permissions, 6 inputs that make garbage. (7, the
BLAS, is in test_blas.py / test_openblas_wheel.py; 8, help and README, in test_readme.py.)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import click
import numpy as np
import pytest

from mlx_fun.observe.saliency import SaliencyAccumulator

from .cli_helpers import expect_error, run

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "data" / "tiny-moe"
SAMPLE = ROOT / "data" / "calibration_sample.jsonl"
MLX_FUN = shutil.which("mlx-fun") or str(Path(sys.executable).with_name("mlx-fun"))


def tree(path: Path) -> dict:
    """Every file below ``path`` (or the file ``path`` itself) → sha256 (to prove an input was not touched)."""
    files = [path] if path.is_file() else sorted(path.rglob("*"))
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files if f.is_file()}


def hidden(path: Path) -> list[str]:
    """Entries a writer may leave beside its outputs (temps, locks): none may survive a run."""
    return sorted(p.name for p in path.iterdir() if p.name.startswith("."))


def cli(*args, cwd=None, umask=None, timeout=180, wrap=None, after="", namespace=False) -> subprocess.CompletedProcess:
    """The installed ``mlx-fun`` in a real subprocess. ``wrap``: a shell prefix (a ulimit, a mount); ``after``:
    shell commands run after it; ``namespace``: all of it in a private user + mount namespace (``unshare -rm``), so
    mounts are visible to that process alone. The exit code stays mlx-fun's."""
    argv = [MLX_FUN, *map(str, args)]
    if wrap or after or namespace:
        cmd = " ".join(f"'{a}'" for a in argv)
        argv = ["sh", "-c", f"{wrap or ''} {cmd}; rc=$?; {after or ':'}; exit $rc"]
        if namespace:
            argv = ["unshare", "-rm", "--propagation", "private", *argv]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=(lambda: os.umask(umask)) if umask is not None else None)


def one_error_line(proc: subprocess.CompletedProcess, *needles) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("Error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def saliency(tmp_path_factory, qwen_model):
    out = tmp_path_factory.mktemp("sal") / "saliency.npz"
    assert run("collect", "--model", qwen_model, "--dataset", SAMPLE, "--output", out, "--max-samples", 4,
               "--max-tokens", 64).exit_code == 0
    return out


def userns_ok() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(["unshare", "-rm", "true"]).returncode == 0


needs_userns = pytest.mark.skipif(not userns_ok(), reason="needs `unshare -rm` (user namespaces) to mount a read-only "
                                                          "or tiny filesystem without root")


# --------------------------------------------------------------------------- 1: outputs that contain an input
def test_output_that_contains_the_model_is_refused_and_nothing_is_deleted(tmp_path, qwen_model, saliency,
                                                                          monkeypatch):
    """The issue's repro: `--output <parent of the model> --force` used to delete the model and its neighbours."""
    par = tmp_path / "par"
    shutil.copytree(qwen_model, par / "m")
    shutil.copy(saliency, par / "saliency.npz")
    (par / "notes.txt").write_text("x\n")
    before = tree(par)
    monkeypatch.chdir(tmp_path)
    expect_error(run("prune", "--model", "par/m", "--saliency", "par/saliency.npz", "--n-prune", 4, "--output", "par",
                     "--force"), "--output par contains the input --model par/m", "write the result to a new path")
    expect_error(run("merge", "--model", "par/m", "--saliency", "par/saliency.npz", "--n-prune", 4,
                     "--dataset", SAMPLE, "--output", "par", "--force"), "--output par contains the input --model")
    assert tree(par) == before and hidden(tmp_path) == [] and hidden(par) == []


@pytest.mark.parametrize("where, needle", [
    ("model", "is the input given to --model"),
    ("model/sub", "is inside the input --model"),
    ("salparent", "contains the input --saliency"),
    ("listparent", "contains the input --expert-list"),
])
def test_every_input_is_protected_from_prune(tmp_path, qwen_model, saliency, where, needle):
    model = tmp_path / "model"
    shutil.copytree(qwen_model, model)
    (tmp_path / "salparent").mkdir()
    sal = tmp_path / "salparent" / "s.npz"
    shutil.copy(saliency, sal)
    (tmp_path / "listparent").mkdir()
    elist = tmp_path / "listparent" / "list.json"
    elist.write_text(json.dumps({"format": "mlx-fun-expert-list", "layers": {"0": {"remove": [0]}, "1": {"remove": [0]}}}))
    before = tree(tmp_path)
    source = ("--expert-list", elist) if where == "listparent" else ("--saliency", sal, "--n-prune", 1)
    expect_error(run("prune", "--model", model, *source, "--output", tmp_path / where, "--force"), needle)
    assert tree(tmp_path) == before


def test_merge_protects_its_dataset_and_collect_its_inputs(tmp_path, qwen_model, saliency):
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(SAMPLE, data / "calib.jsonl")
    expect_error(run("merge", "--model", qwen_model, "--saliency", saliency, "--n-prune", 2, "--dataset",
                     data / "calib.jsonl", "--output", data, "--force"), "contains the input --dataset")
    expect_error(run("collect", "--model", qwen_model, "--dataset", data / "calib.jsonl", "--output",
                     data / "calib.jsonl"), "is the input given to --dataset")
    expect_error(run("collect", "--model", qwen_model, "--dataset", SAMPLE, "--output", Path(qwen_model) / "s.npz"),
                 "is inside the input --model")
    assert (data / "calib.jsonl").read_bytes() == SAMPLE.read_bytes()


def test_current_directory_and_home_are_never_replaced(tmp_path, qwen_model, saliency, monkeypatch):
    """`prune --output . --force` crashed with `ValueError: PosixPath('.') has an empty name` after the work."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("mine")
    monkeypatch.chdir(work)
    expect_error(run("prune", "--model", qwen_model, "--saliency", saliency, "--n-prune", 1, "--output", ".",
                     "--force"), "--output . is the current directory", "(e.g. ./result)")
    expect_error(run("prune", "--model", qwen_model, "--saliency", saliency, "--n-prune", 1, "--output", "..",
                     "--force"), "is a parent of the current directory")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    expect_error(run("prune", "--model", qwen_model, "--saliency", saliency, "--n-prune", 1, "--output", "~",
                     "--force"), "is the home directory")
    assert (work / "keep.txt").read_text() == "mine" and sorted(os.listdir(work)) == ["keep.txt"]


# --------------------------------------------------------------------------- 2: saliency of another model
def _like(acc_path: Path, **changes) -> SaliencyAccumulator:
    acc = SaliencyAccumulator.load(acc_path)
    for key, value in changes.items():
        setattr(acc, key, value)
    return acc


def test_saliency_of_another_model_type_or_top_k_is_refused(tmp_path, qwen_model, saliency):
    mixtral = tmp_path / "mixtral.npz"
    _like(saliency, model_type="mixtral").save(mixtral)  # same layers, experts and k: only the type differs
    expect_error(run("prune", "--model", qwen_model, "--saliency", mixtral, "--n-prune", 2, "--output",
                     tmp_path / "out"), "model_type is mixtral in the file but qwen3_moe in the model")
    topk = tmp_path / "topk.npz"
    _like(saliency, top_k=4).save(topk)
    expect_error(run("merge", "--model", qwen_model, "--saliency-source", "file", "--saliency", topk, "--n-prune", 2,
                     "--dataset", SAMPLE,
                     "--output", tmp_path / "out"), "top_k is 4 in the file but 2 in the model")
    assert not (tmp_path / "out").exists() and hidden(tmp_path) == []


def test_a_file_of_another_tool_is_used_with_a_warning(tmp_path, qwen_model, saliency):
    legacy = tmp_path / "legacy.npz"
    arrays = {k: v for k, v in np.load(saliency).items() if k not in ("model_type", "top_k")}
    np.savez(legacy, **arrays)
    res = run("prune", "--model", qwen_model, "--saliency", legacy, "--n-prune", 2, "--output", tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert "records no model_type or top_k (written by another tool?)" in res.output


def _collected_on(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if "was collected on" in ln]


def test_saliency_of_other_weights_warns_once_and_stats_merge_keeps_where_it_came_from(tmp_path, qwen_model,
                                                                                       make_model, saliency):
    """Issue 44: a file collected on a model of the same shape but other weights (a base for its fine-tune) was
    used silently. collect records the model (name, weights fingerprint) and the dataset; prune / merge / quantize
    warn in one line when the fingerprint is not the model's, say nothing when it is (a copy of the directory
    too) or when the file records none."""
    from mlx_fun.observe import provenance

    acc = SaliencyAccumulator.load(saliency)
    assert acc.provenance["source_model"] == qwen_model.name and acc.provenance["source_dataset"] == str(SAMPLE)
    assert acc.provenance["source_fingerprint"] == provenance.fingerprint(qwen_model)
    assert len(acc.provenance["source_samples_sha256"]) == 64
    tuned = make_model("qwen3_moe", seed=1)  # the same shape, other weights
    prune = ("prune", "--saliency", saliency, "--n-prune", 2)
    res = run(*prune, "--model", tuned, "--output", tmp_path / "p-tuned")
    assert res.exit_code == 0, res.output
    (line,) = _collected_on(res.output)
    assert line.startswith(f"Warning: --saliency {saliency} was collected on {qwen_model.name} (weights "
                           f"{acc.provenance['source_fingerprint'][:12]}), not on this model {tuned.name} "), line
    assert "collecting on a base and pruning its fine-tune is legitimate — check it is what you meant." in line
    res = run("quantize", "--model", tuned, "--saliency", saliency, "--cold-layers", 1, "--cold-bits", 2,
              "--expert-bits", 4, "--expert-group-size", 32, "--output", tmp_path / "q-tuned")
    assert res.exit_code == 0 and len(_collected_on(res.output)) == 1, res.output
    res = run("merge", "--model", tuned, "--saliency-source", "file", "--saliency", saliency, "--n-prune", 2,
              "--dataset", SAMPLE,
              "--max-samples", 2, "--max-tokens", 16, "--output", tmp_path / "m-tuned")
    assert res.exit_code == 0 and len(_collected_on(res.output)) == 1, res.output
    copy = shutil.copytree(qwen_model, tmp_path / "copy-of-the-model")  # the same weights elsewhere: no warning
    for model, out in ((qwen_model, "p-same"), (copy, "p-copy")):
        res = run(*prune, "--model", model, "--output", tmp_path / out)
        assert res.exit_code == 0 and not _collected_on(res.output), res.output
    old = tmp_path / "old.npz"  # a file from before the fields: nothing to compare, nothing said
    np.savez(old, **{k: v for k, v in np.load(saliency).items() if not k.startswith("source_")})
    res = run("prune", "--saliency", old, "--n-prune", 2, "--model", tuned, "--output", tmp_path / "p-old")
    assert res.exit_code == 0 and not _collected_on(res.output), res.output
    # stats-merge keeps each field all its inputs agree on: here the model, not the two datasets
    other = _like(saliency, freq=acc.freq + 1)
    other.provenance = {**acc.provenance, "source_dataset": "prose.jsonl", "source_samples_sha256": "0" * 64}
    other.save(tmp_path / "prose.npz")
    assert run("stats-merge", "--files", saliency, "--files", tmp_path / "prose.npz", "--output",
               tmp_path / "m.npz").exit_code == 0
    merged = SaliencyAccumulator.load(tmp_path / "m.npz").provenance
    assert merged == {k: acc.provenance[k] for k in ("source_model", "source_fingerprint")}
    res = run("prune", "--saliency", tmp_path / "m.npz", "--n-prune", 2, "--model", tuned, "--output",
              tmp_path / "p-merged")
    assert res.exit_code == 0 and len(_collected_on(res.output)) == 1, res.output


def test_a_fingerprint_samples_every_tensor(tmp_path, qwen_model):
    """One attention matrix rewritten (a merged LoRA) changes the fingerprint; so does config.json."""
    import mlx.core as mx

    from mlx_fun.observe.provenance import fingerprint

    tuned = shutil.copytree(qwen_model, tmp_path / "tuned")
    (weights,) = tuned.glob("model*.safetensors")
    tensors = mx.load(str(weights))
    name = next(k for k in sorted(tensors) if "q_proj.weight" in k)
    tensors[name] = tensors[name] + 0.01
    mx.save_safetensors(str(weights), tensors, metadata={"format": "mlx"})
    assert fingerprint(tuned) != fingerprint(qwen_model)
    again = shutil.copytree(qwen_model, tmp_path / "again")
    assert fingerprint(again) == fingerprint(qwen_model)
    (again / "config.json").write_text((again / "config.json").read_text().replace("{", "{\"note\": 1, ", 1))
    assert fingerprint(again) != fingerprint(qwen_model)
    from mlx_fun.errors import UserError

    bad = tmp_path / "bad.npz"
    np.savez(bad, freq=np.ones((2, 8)), source_model=np.array([1, 2]))
    with pytest.raises(UserError, match="'source_model' is not a text"):
        SaliencyAccumulator.load(bad)


def test_stats_refuse_the_same_statistics_twice_and_another_top_k(tmp_path, saliency):
    copy = tmp_path / "copy.npz"
    shutil.copy(saliency, copy)
    for args in (("stats-merge", "--files", saliency, "--files", saliency), ("stats-merge", "--files", saliency,
                                                                            "--files", copy)):
        expect_error(run(*args, "--output", tmp_path / "m.npz"), "holds exactly the same statistics as")
    expect_error(run("stats-diff", "--file1", saliency, "--file2", copy), "holds exactly the same statistics as")
    other = tmp_path / "k4.npz"
    acc = _like(saliency, top_k=4)
    acc.freq = acc.freq + 1
    acc.save(other)
    expect_error(run("stats-merge", "--files", saliency, "--files", other, "--output", tmp_path / "m.npz"),
                 "top_k is 2 in", "but 4 in")
    assert not (tmp_path / "m.npz").exists()


# --------------------------------------------------------------------------- 3: unwritable, full, failing outputs
@needs_userns
def test_read_only_output_fails_before_the_work(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    setup = f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro} &&"
    proc = cli("collect", "--model", BUNDLED, "--dataset", SAMPLE, "--output", ro / "s.npz", wrap=setup,
               namespace=True)
    one_error_line(proc, f"cannot write --output {ro / 's.npz'}: Read-only file system", "choose a writable location")
    assert "Loading" not in proc.stderr  # refused before the model was even loaded
    proc = cli("prune", "--model", BUNDLED, "--saliency", "x.npz", "--n-prune", 4, "--output", ro / "p", wrap=setup,
               namespace=True)
    assert proc.returncode == 2
    assert os.listdir(ro) == []


@needs_userns
def test_full_disk_is_refused_before_writing(tmp_path):
    sal = tmp_path / "s.npz"
    assert run("collect", "--model", BUNDLED, "--dataset", SAMPLE, "--output", sal, "--max-samples", 2,
               "--max-tokens", 32).exit_code == 0
    small = tmp_path / "small"
    small.mkdir()
    proc = cli("prune", "--model", BUNDLED, "--saliency", sal, "--n-prune", 8, "--output", small / "p",
               wrap=f"mount -t tmpfs -o size=8m tmpfs {small} &&", after=f"echo left: $(ls -A {small})",
               namespace=True)
    one_error_line(proc, "not enough free space for --output", "needs about 20.2 MiB", "8.0 MiB is free there")
    assert proc.stdout.strip() == "left:"  # listed after the failed run, inside its namespace: the tmpfs is empty


def test_a_write_that_fails_midway_leaves_nothing(tmp_path):
    """A real write error (the file size limit, EFBIG) halfway through the weights: one line, no partial output."""
    sal = tmp_path / "s.npz"
    assert run("collect", "--model", BUNDLED, "--dataset", SAMPLE, "--output", sal, "--max-samples", 2,
               "--max-tokens", 32).exit_code == 0
    proc = cli("prune", "--model", BUNDLED, "--saliency", sal, "--n-prune", 8, "--output", tmp_path / "p",
               wrap="trap '' XFSZ; ulimit -f 4096;")
    one_error_line(proc, "writing --output", "failed", "nothing was written")
    assert not (tmp_path / "p").exists() and hidden(tmp_path) == []


def test_io_errors_are_one_line_and_exit_2(tmp_path, qwen_model):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("hello world")
    (data / "dangling.txt").symlink_to(tmp_path / "gone.txt")
    proc = cli("collect", "--model", qwen_model, "--dataset", data, "--output", tmp_path / "s.npz")
    one_error_line(proc, "cannot read", "dangling.txt (No such file or directory)")
    broken = tmp_path / "broken"
    shutil.copytree(qwen_model, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    proc = cli("collect", "--model", broken, "--dataset", SAMPLE, "--output", tmp_path / "s.npz")
    one_error_line(proc, f"could not load --model {broken} with mlx-lm", "interrupted download or copy?")
    assert not (tmp_path / "s.npz").exists() and hidden(tmp_path) == []


def test_unexpected_errors_are_one_line_unless_debug(monkeypatch):
    from mlx_fun.cli import main
    from mlx_fun.cli.common import friendly_errors

    @click.command("boom")
    @friendly_errors
    def boom():
        raise RuntimeError("something broke\nover two lines")

    main.add_command(boom)
    try:
        res = run("boom")
        assert res.exit_code == 1
        assert res.output.strip() == ("Error: internal error RuntimeError: something broke over two lines (run with "
                                      "`mlx-fun --debug` or MLX_FUN_DEBUG=1 for the traceback, and please report it).")
        with pytest.raises(RuntimeError, match="something broke"):
            run("--debug", "boom")
        monkeypatch.setenv("MLX_FUN_DEBUG", "1")
        with pytest.raises(RuntimeError):
            run("boom")
    finally:
        main.commands.pop("boom")


# --------------------------------------------------------------------------- 4: interrupted and concurrent runs
def _wait_for(cond, timeout=60.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return False


def _temps(parent: Path, name: str) -> list[Path]:
    return [p for p in parent.iterdir() if p.name.startswith(f".{name}.mlxfun-")]


def _complete(out: Path) -> bool:
    meta = out / "reap_metadata.json"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    return meta.is_file() and all((out / f).is_file() for f in set(index["weight_map"].values()))


@pytest.fixture(scope="module")
def bundled_saliency(tmp_path_factory):
    out = tmp_path_factory.mktemp("bsal") / "s.npz"
    assert run("collect", "--model", BUNDLED, "--dataset", SAMPLE, "--output", out, "--max-samples", 2,
               "--max-tokens", 32).exit_code == 0
    return out


#: A ``sitecustomize`` for the child: an audit hook (it sees every os.mkdir / open / rename the writer makes) that
#: stops the process (SIGSTOP) at the first audited event once its output's temp is in the state ``PAUSE_AT``
#: names — "reserved": the temp exists; "writing": the temp holds a file — so a test kills it in exactly that
#: state, however slow or loaded the machine (a poll from outside can miss a write that starts and ends between
#: two looks).
PAUSE_HOOK = """
import os, signal, sys

_at, _prefix = os.environ["PAUSE_AT"], os.environ["PAUSE_PREFIX"]
_state = {"temp": None, "busy": False, "done": False}


def _hook(event, args):
    if _state["done"] or _state["busy"]:
        return
    _state["busy"] = True
    try:
        if event == "os.mkdir" and os.path.basename(os.fsdecode(args[0])).startswith(_prefix):
            _state["temp"] = os.fsdecode(args[0])  # raised before the directory exists: check at the next event
        elif _state["temp"] and os.path.isdir(_state["temp"]) and (_at == "reserved" or os.listdir(_state["temp"])):
            _state["done"] = True
            os.kill(os.getpid(), signal.SIGSTOP)
    finally:
        _state["busy"] = False


sys.addaudithook(_hook)
"""


def _start_paused(args: list, hook_dir: Path, at: str, prefix: str) -> subprocess.Popen:
    """Start ``args`` with :data:`PAUSE_HOOK` and return once it is stopped at ``at`` (waitpid, no guessing)."""
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(PAUSE_HOOK)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hook_dir), os.environ.get("PYTHONPATH", "")]),
               PAUSE_AT=at, PAUSE_PREFIX=prefix)
    proc = subprocess.Popen(list(map(str, args)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 600  # only against a hang: the wait ends when the child stops (or exits)
    while time.monotonic() < deadline:
        pid, status = os.waitpid(proc.pid, os.WNOHANG | os.WUNTRACED)
        if pid and os.WIFSTOPPED(status):
            return proc
        if pid:  # it exited without reaching the state: nothing to kill
            proc.returncode = os.waitstatus_to_exitcode(status)
            pytest.fail(f"exited with {proc.returncode} before its temp was {at}:\n{proc.stderr.read()}")
        time.sleep(0.01)
    proc.kill()
    pytest.fail(f"not stopped at {at} within 600 s:\n{proc.communicate()[1]}")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
@pytest.mark.parametrize("point", ["reserved", "writing", "0.4s", "1.2s"])
def test_killed_prune_leaves_no_temp_after_the_next_run(tmp_path, bundled_saliency, sig, point):
    """Killed with its output reserved, half written, or at a given time: afterwards the output is absent or
    complete, and the next run leaves no temp. "reserved" and "writing" are reached by stopping the child in that
    state (:data:`PAUSE_HOOK`), not by polling for it: a poll failed once on a loaded 2-core machine (issue 29
    row 26), the whole write having started and ended between two looks."""
    out = tmp_path / "out"
    args = [MLX_FUN, "prune", "--model", BUNDLED, "--saliency", bundled_saliency, "--n-prune", 8, "--output", out]
    if point in ("reserved", "writing"):
        proc = _start_paused(args, tmp_path.parent / f"{tmp_path.name}-hook", point, ".out.mlxfun-")
        temps = _temps(tmp_path, "out")
        assert len(temps) == 1 and not out.exists()
        assert point == "reserved" or any(temps[0].iterdir())  # "writing": a file is in it
        proc.send_signal(sig)
        if sig != signal.SIGKILL:
            os.kill(proc.pid, signal.SIGCONT)  # a stopped process acts on SIGTERM once it runs again
    else:  # any moment: the run may not have started writing, or may have finished
        proc = subprocess.Popen(list(map(str, args)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(float(point[:-1]))
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    if sig == signal.SIGTERM and proc.returncode != -signal.SIGTERM:  # -15: it died before setting up, no temp yet
        assert proc.returncode in (143, 0), err
        if proc.returncode == 143:
            assert err.strip().splitlines()[-1] == "Interrupted by SIGTERM; outputs not yet complete were removed."
    if sig == signal.SIGTERM:
        assert not _temps(tmp_path, "out")  # SIGTERM cleans up at once
        if point in ("reserved", "writing"):
            assert proc.returncode == 143, err  # stopped inside the writer: its handler ran
    assert not out.exists() or _complete(out)  # absent or complete, never partial
    if point in ("reserved", "writing"):
        assert not out.exists()
    again = cli("prune", "--model", BUNDLED, "--saliency", bundled_saliency, "--n-prune", 8, "--output", out,
                "--force")
    assert again.returncode == 0, again.stderr
    assert hidden(tmp_path) == [] and _complete(out)


def test_second_run_on_the_same_output_is_refused_while_the_first_runs(tmp_path):
    data = tmp_path / "calib.jsonl"
    text = (ROOT / "mlx_fun" / "core" / "writer.py").read_text()
    pieces = len(text) // 900
    # 48 samples: long enough that the second run, slow to start on a busy machine, still finds the first one running
    data.write_text("".join(json.dumps({"content": text[i % pieces * 900:(i % pieces + 1) * 900] * 3}) + "\n"
                            for i in range(48)))
    out = tmp_path / "s.npz"
    args = [MLX_FUN, "collect", "--model", BUNDLED, "--dataset", data, "--output", out, "--max-tokens", 512]
    first = subprocess.Popen(list(map(str, args)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert _wait_for(lambda: (tmp_path / ".s.npz.lock").exists())
    second = cli(*args[1:])
    one_error_line(second, f"--output {out} is being written by another mlx-fun run (pid {first.pid})",
                   "wait for it to finish or choose another path")
    assert first.poll() is None, "the first run should still be working"
    out_text, err = first.communicate(timeout=120)
    assert first.returncode == 0 and "Wrote" in out_text, err
    assert SaliencyAccumulator.load(out).total_tokens > 1000 and hidden(tmp_path) == []


# --------------------------------------------------------------------------- 5: permissions
@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, "0o644", "0o755"), (0o077, "0o600", "0o700")])
def test_outputs_follow_the_users_umask(tmp_path, bundled_saliency, umask, file_mode, dir_mode):
    proc = cli("prune", "--model", BUNDLED, "--saliency", bundled_saliency, "--n-prune", 8, "--output",
               tmp_path / "p", umask=umask)
    assert proc.returncode == 0, proc.stderr
    assert oct((tmp_path / "p").stat().st_mode & 0o777) == dir_mode
    assert {oct(f.stat().st_mode & 0o777) for f in (tmp_path / "p").iterdir()} == {file_mode}
    proc = cli("collect", "--model", BUNDLED, "--dataset", SAMPLE, "--output", tmp_path / "new" / "s.npz",
               "--max-samples", 1, "--max-tokens", 16, umask=umask)
    assert proc.returncode == 0, proc.stderr
    assert oct((tmp_path / "new" / "s.npz").stat().st_mode & 0o777) == file_mode
    assert oct((tmp_path / "new").stat().st_mode & 0o777) == dir_mode


# --------------------------------------------------------------------------- 6: inputs that make garbage
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-0.5"])
def test_temperature_must_be_finite(qwen_model, value):
    res = run("smoke-test", "--model", qwen_model, "--temp", value)
    assert res.exit_code == 2
    (line,) = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert "Invalid value for '--temp'" in line
    assert ("is not a finite number" in line) if "inf" in value or value == "nan" else ("not in the range" in line)


def test_nan_is_refused_by_every_float_option(tmp_path):
    res = run("demo", "--prune-fraction", "nan", "--output", tmp_path / "d")
    assert res.exit_code == 2 and "is not a finite number" in res.output and not (tmp_path / "d").exists()
    res = run("stats-purge", "--input", tmp_path / "a.npz", "--output", tmp_path / "b.npz", "--min-freq", "nan")
    assert res.exit_code == 2 and "is not a finite number" in res.output


def test_prompts_and_samples_longer_than_the_context_warn(tmp_path, make_model):
    model = make_model("qwen3_moe", max_position_embeddings=48)
    res = run("smoke-test", "--model", model, "--prompt", "word " * 40, "--max-tokens", 20)
    assert res.exit_code == 0, res.output
    assert "longer than the model's context of 48 tokens (max_position_embeddings)" in res.output
    res = run("collect", "--model", model, "--dataset", SAMPLE, "--output", tmp_path / "s.npz", "--max-samples", 4,
              "--max-tokens", 256)
    assert res.exit_code == 0 and "sample(s) are longer than the model's context of 48 tokens" in res.output
    assert "Lower --max-tokens to 48" in res.output
    res = run("smoke-test", "--model", model, "--prompt", "word", "--max-tokens", 8)
    assert "context" not in res.output
