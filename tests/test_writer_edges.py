"""The writer at its edges (issue 29, rows 19 and 20): a disk already full leaves nothing of ours behind, not even
an empty lock; the free-space refusal says it keeps a margin; the dashboard never offers our temp or lock files."""

from __future__ import annotations

import json

from mlx_fun.saliency import SaliencyAccumulator

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
