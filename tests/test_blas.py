"""The fast-BLAS preload: status line, re-exec (once), CLI and doctor, pytest itself."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_fun.runtime import blas
from mlx_fun.runtime.openblas_wheel import cache_dir as blas_cache

LINUX = sys.platform.startswith("linux")
REPO = Path(__file__).resolve().parents[1]
OPENBLAS = blas.find_fast_blas() if LINUX else None
linux_only = pytest.mark.skipif(not LINUX, reason="LD_PRELOAD / /proc are Linux-only")
needs_openblas = pytest.mark.skipif(
    not OPENBLAS or blas.cuda_backend_installed(),
    reason="no OpenBLAS found (neither the scipy-openblas32 wheel nor a system one), or the CUDA backend is installed",
)

MAPS = "print('MAPS', any(l.rstrip().rsplit('/', 1)[-1].startswith('libopenblas') for l in open('/proc/self/maps')))"


def clean_env(**extra) -> dict:
    """This environment minus whatever the preload / re-exec of the test process added."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS")}
    env = {k: v for k, v in env.items() if not k.startswith("MLX_FUN_") and not k.startswith("PYTEST_")}
    env.update(extra)
    return env


def run(args, env, timeout=60, cwd=None):
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def blas_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("blas: ")]


# ------------------------------------------------------------------------------------------- CLI


def test_version_shows_blas_line():
    exe = shutil.which("mlx-fun") or str(Path(sys.executable).with_name("mlx-fun"))
    assert os.path.exists(exe), "the mlx-fun console script is installed by `pip install -e .`"
    out = run([exe, "--version"], clean_env())
    assert "mlx-fun " in out
    lines = blas_lines(out)
    assert len(lines) == 1
    if OPENBLAS and not blas.cuda_backend_installed():
        assert "preloaded" in lines[0], out


@linux_only
def test_disabled_says_so_and_does_not_preload():
    env = clean_env(MLX_FUN_NO_FAST_BLAS="1")
    out = run([sys.executable, "-m", "mlx_fun", "--version"], env)
    assert blas_lines(out) == ["blas: disabled by MLX_FUN_NO_FAST_BLAS=1"]
    code = f"from mlx_fun.runtime.blas import maybe_reexec; maybe_reexec(); import mlx.core; {MAPS}"
    out = run([sys.executable, "-c", code], env)
    assert "MAPS False" in out


@linux_only
@needs_openblas
def test_doctor_reports_openblas_preloaded():
    out = run([sys.executable, "-m", "mlx_fun", "doctor"], clean_env())
    for key in ("mlx-fun:", "python:", "mlx:", "mlx-lm:", "default device:", "backend: cpu", "GFLOP/s"):
        assert key in out, out
    (line,) = blas_lines(out)
    assert line.startswith("blas: OpenBLAS preloaded ("), line


# --------------------------------------------------------------------------------- re-exec once

START = "import os; print('start', os.environ.get('MLX_FUN_BLAS_REEXEC'), flush=True)"
REEXEC = "from mlx_fun.runtime.blas import maybe_reexec; maybe_reexec(); maybe_reexec()"


@linux_only
@needs_openblas
def test_reexec_happens_once_and_preloads():
    out = run([sys.executable, "-c", f"{START}; {REEXEC}; print('after', flush=True); {MAPS}"], clean_env())
    assert out.splitlines() == ["start None", "start 1", "after", "MAPS True"]


@linux_only
@needs_openblas
def test_marker_prevents_any_reexec():
    env = clean_env(MLX_FUN_BLAS_REEXEC="1")
    out = run([sys.executable, "-c", f"{START}; {REEXEC}; print('after', flush=True); {MAPS}"], env)
    assert out.splitlines() == ["start 1", "after", "MAPS False"]


@linux_only
@needs_openblas
def test_broken_blas_library_falls_back_with_a_warning(tmp_path):
    """MLX_FUN_BLAS naming a missing file, or a file that does not load, is reported on stderr and the next fast
    BLAS is preloaded instead (it used to be ignored silently, or to abort every command with exit 127)."""
    bogus = tmp_path / "libnotblas.so"
    bogus.write_text("not an ELF file\n")
    for value, problem in ((bogus, "cannot be loaded"), (tmp_path / "nonexistent.so", "does not exist")):
        proc = subprocess.run([sys.executable, "-c", f"{START}; {REEXEC}; print('after', flush=True); {MAPS}"],
                              env=clean_env(MLX_FUN_BLAS=str(value)), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines() == ["start None", "start 1", "after", "MAPS True"]
        warning = [ln for ln in proc.stderr.splitlines() if ln.startswith("mlx-fun: warning:")]
        assert len(warning) == 1 and f"MLX_FUN_BLAS={value} {problem}" in warning[0], proc.stderr


def _plan(environ=None, modules=(), library="/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0", cuda=False):
    return blas._reexec_env(dict(environ or {}), set(modules), library, cuda)


def test_reexec_plan(monkeypatch):
    monkeypatch.setattr(blas, "_platform", lambda: "linux")
    lib = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
    env = _plan({"PATH": "/bin", "LD_PRELOAD": "/opt/libfoo.so"})
    assert env["LD_PRELOAD"] == f"{lib}:/opt/libfoo.so"  # prepended, the user's preload kept
    assert env["MLX_FUN_BLAS_REEXEC"] == "1" and env["PATH"] == "/bin"
    if blas.DEFAULT_OPENBLAS_THREADS is None:
        assert "OPENBLAS_NUM_THREADS" not in env
    assert _plan({"OPENBLAS_NUM_THREADS": "3"})["OPENBLAS_NUM_THREADS"] == "3"  # a user value wins
    assert _plan({})["LD_PRELOAD"] == lib
    assert _plan({"MLX_FUN_BLAS_REEXEC": "1"}) is None  # one attempt only
    assert _plan({"LD_PRELOAD": lib}) is None  # already preloaded
    assert _plan({"LD_PRELOAD": "/x/libopenblasp-r0.3.21.so"}) is None
    assert _plan({"MLX_FUN_NO_FAST_BLAS": "1"}) is None
    assert _plan({"MLX_FUN_NO_FAST_BLAS": "0"}) is not None
    assert _plan(modules={"mlx", "mlx.core"}) is None  # too late
    assert _plan(cuda=True) is None
    assert _plan(library=None) is None
    monkeypatch.setattr(blas, "_platform", lambda: "darwin")
    assert _plan({}) is None


def test_maybe_reexec_is_noop_once_mlx_is_imported(monkeypatch):
    import mlx.core  # noqa: F401

    calls = []
    monkeypatch.setattr(os, "execv", lambda *a: calls.append(a))
    monkeypatch.delenv("MLX_FUN_BLAS_REEXEC", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    blas.maybe_reexec()
    assert calls == []


def test_maybe_reexec_survives_failed_exec(monkeypatch):
    monkeypatch.setattr(blas, "_platform", lambda: "linux")
    monkeypatch.setattr(blas, "find_fast_blas", lambda *a, **k: "/opt/libopenblas.so.0")
    monkeypatch.setattr(blas, "_mapped_blas", lambda library=None: None)
    monkeypatch.setattr(blas, "cuda_backend_installed", lambda: False)
    monkeypatch.setitem(sys.modules, "mlx", None)
    monkeypatch.delitem(sys.modules, "mlx")
    monkeypatch.delitem(sys.modules, "mlx.core", raising=False)
    for var in ("MLX_FUN_BLAS_REEXEC", "MLX_FUN_NO_FAST_BLAS", "LD_PRELOAD"):
        monkeypatch.setenv(var, "")  # recorded, so whatever maybe_reexec sets below is undone after the test
        monkeypatch.delenv(var)
    calls = []

    def failing_execv(path, argv):
        calls.append((path, argv, os.environ.get("LD_PRELOAD")))
        raise OSError("exec failed")

    monkeypatch.setattr(os, "execv", failing_execv)
    blas.maybe_reexec()
    blas.maybe_reexec()
    assert calls == [(sys.executable, list(sys.orig_argv), "/opt/libopenblas.so.0")]
    assert "LD_PRELOAD" not in os.environ  # restored
    assert os.environ["MLX_FUN_BLAS_REEXEC"] == "1"


# ---------------------------------------------------------------------------------- status line


@pytest.fixture
def fake(monkeypatch):
    for var in ("MLX_FUN_NO_FAST_BLAS", "OPENBLAS_NUM_THREADS", "MLX_FUN_BLAS"):
        monkeypatch.delenv(var, raising=False)

    def setup(platform="linux", library=None, mapped=None, cuda=False, threads=None):
        monkeypatch.setattr(blas, "_platform", lambda: platform)
        monkeypatch.setattr(blas, "find_fast_blas", lambda *a, **k: library)
        monkeypatch.setattr(blas, "_mapped_blas", lambda library=None: mapped)
        monkeypatch.setattr(blas, "cuda_backend_installed", lambda: cuda)
        monkeypatch.setattr(blas, "_openblas_threads", lambda path: threads)

    return setup


LIB = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
REAL = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so"


def test_status_preloaded(fake, monkeypatch):
    fake(library=LIB, mapped=REAL, threads=2)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    assert blas.blas_status() == f"blas: OpenBLAS preloaded ({REAL}, OPENBLAS_NUM_THREADS=1, 2 threads)"


def test_status_preloaded_by_hand_wins_over_disable(fake, monkeypatch):
    fake(library=LIB, mapped=REAL)
    monkeypatch.setenv("MLX_FUN_NO_FAST_BLAS", "1")
    assert blas.blas_status().startswith("blas: OpenBLAS preloaded (")


def test_status_reference(fake):
    fake()
    status = blas.blas_status()
    assert status.startswith("blas: reference BLAS of the mlx[cpu] wheel (slow)")
    assert "pip install scipy-openblas32" in status and "libopenblas0-pthread" in status


def test_status_installed_not_preloaded(fake):
    fake(library=LIB)
    status = blas.blas_status()
    assert status.startswith("blas: reference BLAS") and f"LD_PRELOAD={LIB}" in status


def test_status_disabled(fake, monkeypatch):
    fake(library=LIB)
    monkeypatch.setenv("MLX_FUN_NO_FAST_BLAS", "1")
    assert blas.blas_status() == "blas: disabled by MLX_FUN_NO_FAST_BLAS=1"


def test_status_macos_and_cuda(fake):
    fake(platform="darwin")
    assert blas.blas_status() == "blas: not needed (macOS Accelerate)"
    fake(library=LIB, cuda=True)
    assert blas.blas_status() == "blas: not needed (CUDA backend)"


# ------------------------------------------------------------------------------ library search


def test_find_fast_blas(monkeypatch, tmp_path):
    monkeypatch.setattr(blas, "_platform", lambda: "darwin")
    assert blas.find_fast_blas() is None
    monkeypatch.setattr(blas, "_platform", lambda: "linux")
    lib = tmp_path / "libmyblas.so"
    lib.write_bytes(b"")
    monkeypatch.setenv("MLX_FUN_BLAS", str(lib))
    assert blas.find_fast_blas() == str(lib)  # without check=True nothing is loaded
    notes = []
    fallback = blas.find_fast_blas(notes, check=True)
    assert fallback != str(lib) and notes and "cannot be loaded" in notes[0]
    monkeypatch.setenv("MLX_FUN_BLAS", str(tmp_path / "missing.so"))
    notes = []
    system = next((p for p in blas._candidates() if os.path.isfile(p)), None)
    found = blas.find_fast_blas(notes)
    assert notes[0].startswith(f"MLX_FUN_BLAS={tmp_path / 'missing.so'} does not exist")
    if system:
        assert found == system
    monkeypatch.setenv("MLX_FUN_BLAS", "wheel")  # the scipy-openblas32 wheel even when a system one exists
    assert Path(blas.find_fast_blas()).parent == blas_cache()


def test_cuda_backend_installed(monkeypatch):
    from importlib import metadata

    def fake_distribution(name):
        if name == "mlx-cuda-13":
            return object()
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", fake_distribution)
    assert blas.cuda_backend_installed() is True
    monkeypatch.setattr(metadata, "distribution", lambda name: (_ for _ in ()).throw(metadata.PackageNotFoundError(name)))
    assert blas.cuda_backend_installed() is False


def test_blas_module_does_not_import_mlx():
    code = "import sys, mlx_fun.runtime.blas as b; b.blas_status(); b.find_fast_blas(); b.cuda_backend_installed(); print('mlx' in sys.modules)"
    assert run([sys.executable, "-c", code], clean_env(MLX_FUN_NO_FAST_BLAS="1")).strip() == "False"
