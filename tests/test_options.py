"""Issue 42: each option declared once. A command's click options are generated from its job: the job's
``Annotated[..., Opt]`` keyword parameters and its option groups' ``option(...)`` fields carry the default, the
type (range, choices) and the help; every group checks its fields when it is built, so a rule holds for Python
callers and the command line alike."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import click
import pytest

from mlx_fun import jobs
from mlx_fun.cli import COMMANDS, main, module_name
from mlx_fun.cli.options import click_option, declared
from mlx_fun.core.options import Group, Opt, check_value, opt_of
from mlx_fun.datasets.calibration import Calibration
from mlx_fun.errors import UserError, cli_names
from mlx_fun.settings import DISPATCH_MODES, RunSettings, option_groups

PKG = Path(__file__).resolve().parents[1] / "mlx_fun"
#: the jobs that draw calibration samples from a dataset: one Calibration group, not six copies of its fields
CALIBRATED = ("collect", "eval", "merge", "abliterate", "safety_scan", "domain_scan")
#: options a job declares that its command leaves out (``job_options(run, skip=...)``), and why
LEFT_OUT = {"serve": {"token_budget"},  # refused by serve: mlx-lm's server prefills --prefill-step-size per forward
            "merge": {"dequant_cache"}}  # merge refuses a dequantized-experts cache


def _job(command: str):
    return getattr(jobs, module_name(command)).run


def _info(param: click.Parameter) -> dict:
    info = param.to_info_dict()
    info.pop("name", None)
    return info


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_of_a_command_is_the_one_its_job_declares(command):
    """Each click option of the command equals the one generated from its job's declaration (flag, default,
    type with its range or choices, help, required, flag or not), and the command has no other option."""
    cmd = main.commands[command]
    got = {p.name: p for p in cmd.params if isinstance(p, click.Option) and p.name != "help"}
    rows = declared(_job(command))
    want = {}
    for name, _group, opt, default, annotation in rows:
        if name in LEFT_OUT.get(command, ()):
            continue
        probe = click_option(name, opt, default, annotation)(lambda: None)
        want[name] = probe.__click_params__[0]
    assert sorted(got) == sorted(want), f"{command}: options not declared by its job (or missing)"
    for name in want:
        assert _info(got[name]) == _info(want[name]), f"{command} --{name}"


@pytest.mark.parametrize("command", COMMANDS)
def test_no_command_module_declares_an_option_by_hand(command):
    text = (PKG / "cli" / f"{module_name(command)}.py").read_text()
    assert not re.search(r"click\.(option|argument)\(", text), f"cli/{module_name(command)}.py declares an option"


def _groups() -> list[type]:
    seen = {}
    for command in COMMANDS:
        for cls in option_groups(inspect.unwrap(_job(command))).values():
            seen[cls.__qualname__] = cls
    return [seen[k] for k in sorted(seen)]


def test_every_option_group_is_a_group_whose_fields_carry_their_option():
    groups = _groups()
    assert {RunSettings, Calibration} <= set(groups)
    for cls in groups:
        assert issubclass(cls, Group), cls
        assert any(opt_of(f) for f in dataclasses.fields(cls)), cls


def _bounded_fields():
    for cls in _groups():
        for f in dataclasses.fields(cls):
            opt = opt_of(f)
            if opt is not None and isinstance(opt.type, click.IntRange) and opt.type.min is not None:
                yield pytest.param(cls, f.name, opt.type.min, id=f"{cls.__name__}.{f.name}")


@pytest.mark.parametrize("cls, name, low", list(_bounded_fields()))
def test_a_group_refuses_a_value_below_its_range_when_built(cls, name, low):
    """The range declared with the option is the rule: one below it, or a bool, is a one-line UserError naming
    the field (``--field`` under the CLI) before any job runs."""
    with pytest.raises(UserError, match=rf"^{name}= must be a whole number"):
        cls(**{name: low - 1})
    with pytest.raises(UserError, match=rf"^{name}= must be a whole number"):
        cls(**{name: True})
    with cli_names(), pytest.raises(UserError, match=rf"^--{name.replace('_', '-')} must be a whole number"):
        cls(**{name: low - 1})


def test_choices_and_sizes_are_checked_when_a_group_is_built():
    with pytest.raises(UserError, match=r"^dispatch= must be one of auto, mlx-lm, got 'fast'\.$"):
        RunSettings(dispatch="fast")
    with pytest.raises(UserError, match=r"^dequant_cache=: not a byte size"):
        RunSettings(dequant_cache="lots")
    assert RunSettings(dequant_cache="4GiB").dequant_bytes() == 4 << 30
    from mlx_fun.dispatch.experts import MODES

    assert DISPATCH_MODES == MODES


def test_check_value_takes_what_the_option_allows():
    opt = Opt("n", type=click.IntRange(1, 4))
    assert check_value("n", 3, opt) == 3 and check_value("n", None, opt) is None
    for bad in (0, 5, 2.0, "2", False):
        with pytest.raises(UserError, match=r"^n= must be a whole number between 1 and 4"):
            check_value("n", bad, opt)


@pytest.mark.parametrize("name", CALIBRATED)
def test_the_calibrated_jobs_share_one_calibration_group(name):
    run = inspect.unwrap(getattr(jobs, name).run)
    params = inspect.signature(run).parameters
    assert option_groups(run).get("calibration") is Calibration
    assert not {"max_samples", "max_tokens", "text_key", "batch_size"} & set(params)


def test_a_group_field_given_by_name_is_folded_into_the_group(tmp_path):
    """Python callers may still write ``max_samples=2``: the job folds it into its Calibration (and a value the
    group refuses is refused the same way)."""
    from mlx_fun.core.options import check_path

    with pytest.raises(UserError, match=r"^max_samples= must be a whole number >= 1"):
        jobs.collect.run(model="m", dataset="d", output=str(tmp_path / "o.npz"), max_samples=0)
    with pytest.raises(UserError, match="does not exist; pass a JSONL file"):
        check_path("dataset", str(tmp_path / "nope.jsonl"), Opt("d", missing="pass a JSONL file"))


def test_every_job_is_wrapped_where_it_is_defined():
    """Issue 42: the wrappers (repo ids, folding, checks, the input guard) are visible at ``@job`` above each
    ``def run``; nothing wraps a job again in a loop elsewhere."""
    for module in jobs.ALL:
        text = Path(module.__file__).read_text()
        assert re.search(r"^@job(\(any_model=True\))?\ndef run\(", text, re.M), module.__name__
        assert hasattr(module.run, "reads") and module.run.any_model == (module in jobs.ANY_MODEL)
    assert {m.__name__.rsplit(".", 1)[1] for m in jobs.ANY_MODEL} == {"eval", "smoke_test", "tune_dispatch"}
    assert "_resolving(" not in (PKG / "jobs" / "__init__.py").read_text()


@pytest.mark.parametrize("command", [c for c in COMMANDS if "stream_layers" in {p.name for p in main.commands[c].params}])
def test_a_tri_state_flag_given_neither_way_leaves_the_choice_to_the_job(command, tmp_path):
    """``--stream-layers/--no-stream-layers`` parses to True / False, and to None when neither is given (the job's
    automatic choice): click made an unset flag False, so the automatic choice never ran from the command line."""
    cmd = main.commands[command]
    required = [p for p in cmd.params if isinstance(p, click.Option) and p.required]
    base = [arg for p in required for arg in (p.opts[0], str(tmp_path / p.name))]
    for extra, want in (([], None), (["--stream-layers"], True), (["--no-stream-layers"], False)):
        ctx = cmd.make_context(command, base + extra, resilient_parsing=True)
        assert ctx.params["stream_layers"] is want, (command, extra)
