"""OpenBLAS's threads give way to other processes (issue 32, part 3): the governor's rule, its measurement, and the
real thing: a process re-executed with the fast BLAS drops to one thread while other processes spin on every core,
and takes all cores back once they stop. scripts/bench_collect.py --contended N measures what that is worth."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from mlx_fun import blas_threads
from mlx_fun.blas_threads import BUSY, QUIET, Governor

from .test_blas import clean_env, linux_only, needs_openblas


def test_one_thread_from_half_a_core_of_others_all_below_a_quarter_as_it_was_between():
    calls = []
    g = Governor(calls.append, cores=4)
    assert g.decide(0.0) == 4 and g.decide(BUSY) == 1 and g.decide(3.0) == 1
    g.wanted = 1
    assert g.decide((QUIET + BUSY) / 2) == 1  # hysteresis: no flapping around one threshold
    g.wanted = 4
    assert g.decide((QUIET + BUSY) / 2) == 4
    assert g.decide(QUIET - 0.01) == 4


def test_step_switches_only_on_a_change_and_counts_what_others_used(monkeypatch):
    """Others' use = the machine's busy ticks minus this process's, over the interval, in cores."""
    ticks = iter([((100, 1000), 50), ((100 + 200, 1000 + 400), 50 + 20),  # others 180/400 x cores
                  ((300, 1400 + 400), 70 + 10), ((300 + 5, 1800 + 400), 80 + 5)])
    state = {}

    def machine():
        state["now"] = next(ticks)
        return state["now"][0]

    monkeypatch.setattr(blas_threads, "_machine_ticks", machine)
    monkeypatch.setattr(blas_threads, "_own_ticks", lambda: state["now"][1])
    monkeypatch.setattr(blas_threads.os, "cpu_count", lambda: 2)
    calls = []
    g = Governor(calls.append, cores=2)
    g.step()  # the first sample only sets the baseline
    assert calls == []
    g.step()  # (200 - 20) / 400 * 2 = 0.9 cores of others
    assert calls == [1] and g.threads == 1
    g.step()  # no busy ticks but our own 10: others used nothing (clamped at 0), all cores again
    assert calls == [1, 2] and g.threads == 2 and g.switches == 2
    g.step()
    assert calls == [1, 2]


def test_small_forwards_run_one_thread_and_larger_ones_what_the_load_asks_for(monkeypatch):
    calls = []
    g = Governor(calls.append, cores=4)
    monkeypatch.setattr(blas_threads, "_started", g)
    blas_threads.call_size(1)
    assert calls == [1] and g.threads == 1
    blas_threads.call_size(blas_threads.SMALL_TOKENS)
    assert calls == [1]  # no call when nothing changes
    blas_threads.call_size(blas_threads.SMALL_TOKENS + 1)
    assert calls == [1, 4] and g.threads == 4
    g.wanted = 1  # the machine is busy: larger forwards stay on one thread too
    blas_threads.call_size(1)
    blas_threads.call_size(500)
    assert calls == [1, 4, 1] and g.threads == 1


DECODE_PROBE = """
from mlx_fun.blas import maybe_reexec
maybe_reexec()
import mlx.core as mx
from mlx_fun import blas_threads, moe_hook
from mlx_fun.io import load_model
import time
g = blas_threads.start()
g.stop()  # the test decides, not the machine's load: all cores for large forwards
time.sleep(3 * blas_threads.INTERVAL)
g.wanted = g.cores
g.small_calls(True)
g.small_calls(False)
model, _, config = load_model("data/tiny-moe", tokenizer=False)
moe_hook.for_generation(model, config)
mx.eval(model(mx.array([list(range(40))])))
print("prefill", g.threads, flush=True)
mx.eval(model(mx.array([[5]])))
print("decode", g.threads, flush=True)
"""


@linux_only
@needs_openblas
def test_a_preloaded_process_decodes_on_one_openblas_thread_and_prefills_on_all():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", DECODE_PROBE], env=clean_env(), cwd=root, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split() for line in out.stdout.splitlines())
    assert int(lines["prefill"]) >= 2 and lines["decode"] == "1"


PROBE = """
import sys, time
from mlx_fun.blas import maybe_reexec
maybe_reexec()
from mlx_fun import blas_threads
g = blas_threads.start()
print("started", g is not None, g.threads if g else None, flush=True)
for line in sys.stdin:
    time.sleep(float(line))
    print("threads", g.threads, flush=True)
"""


@linux_only
@needs_openblas
def test_a_preloaded_process_drops_to_one_thread_under_contention_and_takes_the_cores_back():
    proc = subprocess.Popen([sys.executable, "-c", PROBE], env=clean_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        started = proc.stdout.readline().split()
        if started[1] != "True":
            pytest.fail(f"the governor did not start in a process with the fast BLAS preloaded: {started}")
        cores = int(started[2])
        assert cores >= 2
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
        try:
            proc.stdin.write("2.0\n")
            proc.stdin.flush()
            assert proc.stdout.readline().split() == ["threads", "1"]
        finally:
            for s in spinners:
                s.kill()
                s.wait()
        time.sleep(0.2)
        proc.stdin.write("2.0\n")
        proc.stdin.flush()
        assert proc.stdout.readline().split() == ["threads", str(cores)]
    finally:
        proc.kill()
        proc.wait()


@linux_only
def test_a_users_thread_count_is_never_touched(monkeypatch):
    monkeypatch.setattr(blas_threads, "_started", None)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    assert blas_threads.start() is None
    monkeypatch.delenv("OPENBLAS_NUM_THREADS")
    monkeypatch.setenv(blas_threads.GOVERNOR_ENV, "0")
    assert blas_threads.start() is None
