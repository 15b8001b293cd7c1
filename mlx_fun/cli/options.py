"""A command's click options, generated from its job (:mod:`mlx_fun.core.options`): one option per ``Annotated``
keyword parameter of the job's ``run`` and per :class:`~mlx_fun.core.options.Opt` field of each of its option
groups, in signature order, with the default, type, range and help declared there — nothing is declared twice.
``job_kwargs`` folds the parsed options back into the groups."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path

import click

from ..core.options import Opt, job_opts, opt_of
from ..core.ranges import FiniteFloat
from ..settings import grouped, option_groups


def declared(run) -> list[tuple[str, str | None, Opt, object, object]]:
    """``(name, group or None, Opt, default, annotation)`` of every command-line option of job ``run``, in
    signature order (a group's fields where the group stands; defaults from the group's default instance)."""
    func = inspect.unwrap(run)
    hints = typing.get_type_hints(func, include_extras=True)
    opts = job_opts(func)
    groups = option_groups(func)
    out = []
    for name, p in inspect.signature(func).parameters.items():
        if name in opts:
            opt, default = opts[name]
            out.append((name, None, opt, default, hints.get(name)))
        elif name in groups:
            group_hints = typing.get_type_hints(groups[name], include_extras=True)
            for f in dataclasses.fields(groups[name]):
                opt = opt_of(f)
                if opt is not None:
                    out.append((f.name, name, opt, getattr(p.default, f.name), group_hints.get(f.name)))
    if "revision" in inspect.signature(run).parameters and "model" in [row[0] for row in out]:
        from ..model.hub import REVISION  # added by the job's resolving wrapper (mlx_fun.model.hub.resolving)

        at = [row[0] for row in out].index("model") + 1
        out.insert(at, ("revision", None, REVISION, None, str | None))
    return [row for row in out if row[2].cli]


def _base(annotation) -> set:
    """The plain types an annotation allows (``Annotated`` and ``Optional`` unwrapped)."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    args = typing.get_args(annotation)
    return set(args) if args and typing.get_origin(annotation) is not list else {annotation}


def click_option(name: str, opt: Opt, default, annotation):
    """The click option of one declared option."""
    base = _base(annotation)
    required = opt.required or default is inspect.Parameter.empty
    shown = f"  [default: {opt.default_text}]" if opt.default_text else ""
    kw = {"help": opt.help + shown, "metavar": opt.metavar, "multiple": opt.multiple}
    tri_state = base <= {bool, type(None)} and not required and default is None and "/" in (opt.flag or "")
    if tri_state:
        pass  # --x/--no-x with default None (set below): neither given leaves the choice to the job
    elif base <= {bool, type(None)} and not required and opt.type is None:
        kw.update(is_flag=True, default=bool(default))
    else:
        kind = opt.type
        if kind is None:
            kind = (click.Path() if Path in base else click.INT if int in base and float not in base
                    else FiniteFloat() if float in base else None)
        kw.update(type=kind, required=required)
        if not required:
            kw["default"] = () if opt.multiple and default is None else default
            kw["show_default"] = not opt.default_text and default is not None and default != ()
    flag = opt.flag or "--" + name.replace("_", "-")
    kw = {k: v for k, v in kw.items() if v is not None}
    if tri_state:
        kw["default"] = None  # kept: without it click makes the flag's default False
    return click.option(flag, *opt.aliases, name, **kw)


def job_options(run, *, skip: tuple[str, ...] = ()):
    """Decorate a click command with every option of job ``run`` (:func:`declared`) but ``skip``."""

    def deco(fn):
        for name, _group, opt, default, annotation in reversed(declared(run)):
            if name not in skip:
                fn = click_option(name, opt, default, annotation)(fn)
        return fn

    return deco


def job_kwargs(run, kwargs: dict) -> dict:
    """The parsed options as ``run``'s keyword arguments: each group's fields built into the group (over the job's
    default instance, :func:`mlx_fun.settings.grouped`), the rest as they are; ``multiple`` options as lists."""
    return grouped(inspect.unwrap(run), {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()})


__all__ = ["click_option", "declared", "job_kwargs", "job_options"]
