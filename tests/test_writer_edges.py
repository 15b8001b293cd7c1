"""The writer at its edges (issue 29, rows 19 and 20): a disk already full leaves nothing of ours behind, not even
an empty lock; the free-space refusal says it keeps a margin; the dashboard never offers our temp or lock files."""

from __future__ import annotations

import json
import os

from mlx_fun.observe.saliency import SaliencyAccumulator

from .test_nothing_lost import BUNDLED, SAMPLE, cli, needs_userns, one_error_line


def _saliency(path, shift=0):
    acc = SaliencyAccumulator(2, 4, model_type="qwen3_moe", top_k=2)
    acc.freq[:] = [[5 + shift, 3, 2, 1], [4, 4, 1, 1 + shift]]
    acc.weighted_freq_sum[:] = acc.freq * 0.5
    acc.reap_sum[:] = acc.freq * 0.25
    acc.ean_sum[:] = acc.freq * 0.75
    acc.token_count = 8
    acc.save(path)
    return path


@needs_userns
def test_a_full_disk_leaves_no_lock_or_temp(tmp_path):
    """stats-purge / stats-diff / eval --output onto a filesystem with no byte free: one line, exit 2, and the only
    thing there afterwards is the file that filled it (the lock's pid used to fail with ENOSPC after the lock file
    was created, and it stayed)."""
    a, b = _saliency(tmp_path / "a.npz"), _saliency(tmp_path / "b.npz", shift=2)
    full = tmp_path / "full"
    full.mkdir()
    fill = f"mount -t tmpfs -o size=256k tmpfs {full} && (dd if=/dev/zero of={full}/filler bs=4k 2>/dev/null; true) &&"
    runs = {
        "stats-purge": ("stats-purge", "--input", a, "--output", full / "p.npz", "--min-freq", 1),
        "stats-diff": ("stats-diff", "--file1", a, "--file2", b, "--output", full / "d.json"),
        "eval": ("eval", "--model", BUNDLED, "--dataset", SAMPLE, "--max-samples", 1, "--max-tokens", 16,
                 "--output", full / "e.json"),
    }
    for name, args in runs.items():
        proc = cli(*args, wrap=fill, after=f"echo left: $(ls -A {full})", namespace=True)
        assert proc.stdout.strip().splitlines()[-1] == "left: filler", (name, proc.stdout)
        line = one_error_line(proc)
        assert "--output" in line and "No space left on device" in line, (name, line)


@needs_userns
def test_the_space_refusal_names_the_margin(tmp_path):
    sal = tmp_path / "s.npz"
    assert cli("collect", "--model", BUNDLED, "--dataset", SAMPLE, "--output", sal, "--max-samples", 2,
               "--max-tokens", 32).returncode == 0
    small = tmp_path / "small"
    small.mkdir()
    proc = cli("prune", "--model", BUNDLED, "--saliency", sal, "--n-prune", 8, "--output", small / "p",
               wrap=f"mount -t tmpfs -o size=30m tmpfs {small} &&", namespace=True)
    one_error_line(proc, "not enough free space for --output", "needs about", "keeps 16.0 MiB more free",
                   "30.0 MiB is free there")


def test_the_merge_tab_never_lists_our_temp_or_lock_files(tmp_path):
    from mlx_fun.ui.common import Context

    good = _saliency(tmp_path / "run.npz")
    (tmp_path / ".run.npz.mlxfun-0a1b2c3d.tmp.npz").write_bytes(good.read_bytes())
    (tmp_path / ".run.npz.lock").write_text("123\n")
    (tmp_path / ".hidden.npz").write_bytes(good.read_bytes())
    (tmp_path / "notes.json").write_text(json.dumps({}))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / ".b.npz.mlxfun-00112233.tmp.npz").write_bytes(good.read_bytes())
    (tmp_path / "sub" / "b.npz").write_bytes(good.read_bytes())
    assert Context(client=None, data_dir=tmp_path).npz_files() == ["run.npz", "sub/b.npz"]


# ------------------------------------------------------------------------- issue 41: the lock, the one rule
def test_the_lock_never_exists_without_its_holders_pid(tmp_path, monkeypatch):
    """Row 15: after every call the writer makes while it takes the lock, the lock file is absent or holds the pid
    (it used to be created empty and filled after the flock, so a second run could read "pid ?")."""
    import fcntl as real_fcntl
    import os as real_os
    import types

    from mlx_fun.core import output_lock, writer

    lock = tmp_path / ".s.json.lock"
    seen = []

    def spy(module, names):
        def wrap(fn):
            def call(*args, **kwargs):
                try:
                    return fn(*args, **kwargs)
                finally:
                    seen.append((fn.__name__, lock.read_text() if lock.exists() else None))
            return call

        attrs = {n: getattr(module, n) for n in dir(module) if not n.startswith("__")}
        return types.SimpleNamespace(**{**attrs, **{n: wrap(attrs[n]) for n in names}})

    for module in (writer, output_lock):  # the lock's own calls and the writer's around them
        monkeypatch.setattr(module, "os", spy(real_os, ("open", "link", "replace", "pwrite", "ftruncate", "close")))
    monkeypatch.setattr(output_lock, "fcntl", spy(real_fcntl, ("flock",)))
    with writer.output(tmp_path / "s.json") as res:
        res.write_json({"ok": True})
    contents = [c for _, c in seen if c is not None]
    assert contents and set(contents) == {f"{real_os.getpid()}\n"}, seen


def _holder(path):
    """A real second process that holds ``path``'s reservation until its stdin closes (told "ready" on stdout)."""
    import subprocess
    import sys

    code = ("import sys; from mlx_fun.core.writer import output\n"
            f"with output({str(path)!r}) as res:\n"
            "    print('ready', flush=True); sys.stdin.read(); res.write_text('theirs')\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_held_lock_names_its_holder_and_a_stale_one_is_taken_over(tmp_path):
    from mlx_fun.core import writer
    from mlx_fun.errors import UserError

    out = tmp_path / "t.json"
    holder = _holder(out)
    try:
        import pytest

        with pytest.raises(UserError, match=rf"being written by another mlx-fun run \(pid {holder.pid}\)"):
            writer.write_text(out, "mine")
    finally:
        holder.communicate("")
    assert holder.returncode == 0 and out.read_text() == "theirs"
    # what a SIGKILLed run leaves: its lock (its flock gone with it) and its pid temp; both taken over / removed
    (tmp_path / ".u.json.lock").write_text("999999\n")
    (tmp_path / ".u.json.lock.mlxfun-0a1b2c3d.tmp").write_text("999999\n")
    said = []
    with writer.output(tmp_path / "u.json", notice=said.append) as res:
        assert (tmp_path / ".u.json.lock").read_text() == f"{os.getpid()}\n"
        res.write_text("mine")
    assert (tmp_path / "u.json").read_text() == "mine" and said == [
        f"Removed {tmp_path / '.u.json.lock.mlxfun-0a1b2c3d.tmp'}, left behind by an interrupted run."]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "u.json"]


def test_a_file_that_appears_during_the_run_is_not_replaced_without_force(tmp_path):
    """Row 1 (the one rule, raced): checked before the work and again at the rename, which is a hard link that
    fails rather than replace."""
    import pytest

    from mlx_fun.core import writer
    from mlx_fun.errors import UserError

    out = tmp_path / "r.json"
    with pytest.raises(UserError, match="was created by something else during this run"):
        with writer.output(out) as res:
            res.write_text("ours")
            out.write_text("theirs, written meanwhile")
    assert out.read_text() == "theirs, written meanwhile" and sorted(tmp_path.iterdir()) == [out]
    with pytest.raises(UserError, match=rf"^output= {out} already exists; pass force= to replace it"):
        writer.write_text(out, "ours")
    writer.write_text(out, "ours", force=True)
    assert out.read_text() == "ours" and sorted(tmp_path.iterdir()) == [out]


def test_without_hard_links_the_lock_and_the_rename_still_work(tmp_path, monkeypatch):
    """Where ``link`` is not supported (some FUSE, SMB and FAT mounts) the lock is taken in place and a new file is
    renamed after a last look: outputs are written, an existing one still refused without force."""
    import errno

    import pytest

    from mlx_fun.core import writer
    from mlx_fun.errors import UserError

    def no_link(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted", str(src))

    monkeypatch.setattr(writer.os, "link", no_link)
    out = tmp_path / "n.json"
    with writer.output(out) as res:
        assert (tmp_path / ".n.json.lock").read_text() == f"{os.getpid()}\n"
        res.write_text("one")
    with pytest.raises(UserError, match="already exists"):
        writer.write_text(out, "two")
    writer.write_text(out, "two", force=True)
    assert out.read_text() == "two" and sorted(tmp_path.iterdir()) == [out]
