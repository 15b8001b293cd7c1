"""Every number a command takes has one declared range, refused in one line before anything loads (issue 41 row 11).

The cases are generated from the click commands themselves: every int / float option of every command gets the
values just outside its declared range (and NaN / ±inf for floats), each of which must exit 2 with exactly one
``Error:`` line naming the option — in milliseconds, so before any model is read. An option without a declared
range fails here until it has one (``click.IntRange`` / :class:`mlx_fun.core.ranges.FiniteFloat`), unless its valid
values depend on another option and its job checks it before loading (``JOB_CHECKED``: run with a real model).
Every ``--seed`` shares one range (:data:`mlx_fun.core.ranges.SEED`), the one the REST server checks too.
"""

from __future__ import annotations

import time
from pathlib import Path

import click
import pytest

from mlx_fun.cli import main
from mlx_fun.core.ranges import FiniteFloat

from .cli_helpers import expect_error, run

ROOT = Path(__file__).resolve().parents[1]
#: options whose allowed values depend on another option (the mode's group sizes): the job refuses them from the
#: config alone, before any weight loads
JOB_CHECKED = {("quantize", "expert_group_size"), ("quantize", "dense_group_size")}
#: options where every finite number means something (only NaN / inf are out of range)
ANY_FINITE = {("amplify", "threshold")}
NO_RANGE = "<no declared range>"


def _numeric(param) -> bool:
    return isinstance(param, click.Option) and isinstance(
        param.type, (click.types.IntParamType, click.types.FloatParamType, FiniteFloat))


def _bad_values(cmd: str, param) -> list[str]:
    """The values just outside ``param``'s declared range (and the non-finite ones for a float)."""
    t = param.type
    lo, hi = getattr(t, "min", None), getattr(t, "max", None)
    if (cmd, param.name) in JOB_CHECKED:
        return ["-1", "0", str(2**64)]
    if lo is None and hi is None and not ((cmd, param.name) in ANY_FINITE and isinstance(t, FiniteFloat)):
        return [NO_RANGE]
    values = []
    is_float = isinstance(t, (click.types.FloatParamType, FiniteFloat))
    if lo is not None:
        values.append(str(lo) if getattr(t, "min_open", False) else str(lo - (1e-3 if is_float else 1)))
    if hi is not None:
        values.append(str(hi) if getattr(t, "max_open", False) else str(hi + (1e-3 if is_float else 1)))
    if is_float:
        values += ["nan", "inf", "-inf"]
    else:
        values += ["1.5"]
    return values


def _cases():
    for name, cmd in sorted(main.commands.items()):
        for p in cmd.params:
            if _numeric(p):
                for value in _bad_values(name, p):
                    yield pytest.param(name, p, value, id=f"{name}--{p.name}={value}")


def _required(cmd: str, command, skip: str, tmp_path) -> list[str]:
    """Values for ``command``'s required options (a real model and fresh outputs where the job must run)."""
    args = []
    for p in command.params:
        if isinstance(p, click.Option) and p.required and p.name != skip:
            value = str(ROOT / "data" / "tiny-moe") if p.name == "model" else str(tmp_path / p.name)
            args += [p.opts[0], value]
    return args


@pytest.mark.parametrize("cmd, param, value", list(_cases()))
def test_every_number_out_of_range_is_one_line_before_anything_loads(cmd, param, value, tmp_path):
    command = main.commands[cmd]
    flag = max(param.opts, key=len)
    assert value != NO_RANGE, f"{cmd} {flag} declares no range: give it a click.IntRange / FiniteFloat"
    start = time.perf_counter()
    got = run(cmd, *_required(cmd, command, param.name, tmp_path), flag, value)
    expect_error(got, flag)
    assert "Traceback" not in got.output
    assert time.perf_counter() - start < 5, "the range was checked after something slow (a model load?)"
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_every_seed_has_the_one_range_the_server_checks_too():
    """`merge --seed -1` reached numpy (internal error) while collect / eval took it; `smoke-test --seed 2**64`
    reached MLX while the server refused it: one range, 0 .. 2**64 - 1, for every --seed and the REST field."""
    from mlx_fun.core.ranges import SEED
    from mlx_fun.serve.params import _rules

    seeds = {name: p.type for name, cmd in main.commands.items() for p in cmd.params if p.name == "seed"}
    assert {"collect", "merge", "eval", "smoke-test", "steer", "safety-scan", "domain-scan", "abliterate"} <= set(seeds)
    assert all(t is SEED for t in seeds.values()), seeds
    assert _rules()["seed"][1] is SEED and (SEED.min, SEED.max) == (0, 2**64 - 1)


def test_the_largest_seed_samples():
    """2**64 - 1 is a seed the sampler takes: its steps go on from 0 as a uint64 does (it used to overflow
    mx.random.key at the second step)."""
    import mlx.core as mx

    from mlx_fun.model.sampling import seed_key

    assert mx.array_equal(seed_key(2**64 - 1, 1), mx.random.key(0)).item()
    assert mx.array_equal(seed_key(2**64 - 1), mx.random.key(2**64 - 1)).item()
