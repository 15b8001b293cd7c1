"""The scipy-openblas32 wheel made preloadable: renamed symbols, a SysV hash table, and MLX really using it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from mlx_fun.runtime import openblas_wheel as ow

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or ow.wheel_library() is None,
                                reason="the scipy-openblas32 wheel is a Linux dependency")


def test_renamed_copy_exports_the_plain_blas_names_and_computes(tmp_path):
    src = ow.wheel_library()
    data = src.read_bytes()
    out = tmp_path / "libopenblas-test.so"
    out.write_bytes(ow.strip_symbol_prefix(data))
    assert len(out.read_bytes()) == len(data)  # patched in place: nothing moves
    if shutil.which("readelf"):  # binutils' view agrees (the loader itself is exercised by verify())
        readelf = subprocess.run(["readelf", "--dyn-syms", "-d", str(out)], capture_output=True, text=True)
        assert "(HASH)" in readelf.stdout and "GNU_HASH" not in readelf.stdout
        assert " cblas_sgemm\n" in readelf.stdout and " scipy_cblas_sgemm\n" not in readelf.stdout
    assert ow.verify(out) is None


def test_patch_refuses_what_it_does_not_understand(tmp_path):
    with pytest.raises(ow.PatchError, match="not a 64-bit"):
        ow.strip_symbol_prefix(b"not an ELF file at all")
    once = ow.strip_symbol_prefix(ow.wheel_library().read_bytes())
    with pytest.raises(ow.PatchError, match="GNU hash"):  # already converted: never patched twice
        ow.strip_symbol_prefix(once)
    bogus = tmp_path / "libbogus.so"
    bogus.write_text("nope")
    assert "cannot be loaded" in ow.verify(bogus)


def test_prepared_copy_is_cached_with_the_users_umask(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    old = os.umask(0o022)
    try:
        path, problem = ow.prepared_library()
    finally:
        os.umask(old)
    assert problem is None and path.parent == tmp_path / "mlx-fun" / "blas"
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp or lock file left
    assert ow.prepared_library() == (path, None)  # reused


def test_mlx_runs_its_matmuls_and_lapack_on_the_wheel(tmp_path):
    """In a fresh process with MLX_FUN_BLAS=wheel, the launcher's re-exec preloads the renamed copy, and MLX's
    CPU matmul and inverse agree with numpy, and the dynamic linker binds libmlx's ``cblas_sgemm`` to that copy
    (LD_DEBUG=bindings: proof that MLX really calls it; the speed itself is measured by
    scripts/benchmarks/bench_collect.py)."""
    code = (
        "from mlx_fun.runtime.blas import maybe_reexec, blas_status; maybe_reexec()\n"
        "import numpy as np, mlx.core as mx\n"
        "a = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)\n"
        "x = mx.array(a); mx.eval(x @ x)\n"
        "err = float(np.abs(np.array(x @ x) - a.astype(np.float64) @ a).max())\n"
        "inv = np.array(mx.linalg.inv(x, stream=mx.cpu))\n"
        "print(blas_status()); print('ERR', err, np.abs(inv @ a - np.eye(512)).max() < 1e-2)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MLX_FUN_BLAS_REEXEC")}
    (tmp_path / "ld").mkdir()
    env.update(MLX_FUN_BLAS="wheel", XDG_CACHE_HOME=str(tmp_path), LD_DEBUG="bindings",
               LD_DEBUG_OUTPUT=str(tmp_path / "ld" / "log"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"blas: OpenBLAS preloaded ({tmp_path}/mlx-fun/blas/libopenblas-"), proc.stdout
    _, err, inv_ok = lines[1].split()
    assert float(err) < 1e-2 and inv_ok == "True"
    bindings = [ln for f in (tmp_path / "ld").iterdir() for ln in f.read_text().splitlines() if "`cblas_sgemm'" in ln]
    assert any("/libmlx.so" in ln and f" to {tmp_path}/mlx-fun/blas/libopenblas-" in ln for ln in bindings), bindings
