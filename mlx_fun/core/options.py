"""Options declared once. A job's options are its keyword parameters and the fields of its option groups
(dataclasses); each carries an :class:`Opt` — its help, its value type (a click type: the range or the choices) and
what to do when a path it names is missing — as ``Annotated[type, Opt(...)]`` on a parameter or
``option(default, ...)`` on a group field. The default is the parameter's or the field's own.

From that one declaration ``mlx_fun.cli.options`` generates the click options of every command, and
:class:`Group` checks every field when a group is built, so a rule (``n_prune >= 1``, a choice, a range) lives in
one place and holds for Python callers and the command line alike::

    @dataclass(frozen=True)
    class Selection(Group):
        n_prune: int | None = option(None, "Experts to remove per layer.", type=click.IntRange(min=1))

    Selection(n_prune=-3)  # UserError: n_prune=: -3 is not in the range x>=1.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass
from typing import Any

import click

from ..errors import UserError, param


@dataclass(frozen=True)
class Opt:
    """How an option is shown and checked. ``help``: its text; ``type``: a click type (``click.IntRange``,
    ``click.Choice``, ``FiniteFloat``, ``click.Path``...; None: from the annotation); ``missing``: for a path
    that must exist, the fix named when it does not (checked before anything loads); ``flag``: the command-line
    name when it is not ``--field-name``; ``aliases``: more names of it (mlx-lm's ``-p``); a ``bool`` with a
    ``type`` (``click.BOOL``) takes a value (``--verbose False``) instead of being a flag; ``metavar`` /
    ``default_text``: what ``--help`` shows; ``required``:
    the command line must give it (a parameter without a default is required anyway); ``cli``: False for a field
    only Python callers set."""

    help: str
    type: Any = None
    missing: str | None = None
    flag: str | None = None
    metavar: str | None = None
    default_text: str | None = None
    required: bool = False
    cli: bool = True
    multiple: bool = False
    aliases: tuple[str, ...] = ()


def option(default: Any = None, help: str = "", **kw) -> Any:
    """A group field with its :class:`Opt` (``dataclasses.field`` with the option in its metadata)."""
    return dataclasses.field(default=default, metadata={"option": Opt(help, **kw)})


def opt_of(f: dataclasses.Field) -> Opt | None:
    return f.metadata.get("option")


def annotated_opt(annotation: Any) -> Opt | None:
    """The :class:`Opt` of an ``Annotated[..., Opt(...)]`` annotation (resolved), else None."""
    for extra in getattr(annotation, "__metadata__", ()):
        if isinstance(extra, Opt):
            return extra
    return None


def job_opts(run) -> dict[str, tuple[Opt, Any]]:
    """``{parameter: (Opt, default)}`` of a job's ``Annotated`` keyword parameters, in signature order
    (``inspect.Parameter.empty`` as the default of a required one)."""
    import inspect

    func = inspect.unwrap(run)
    hints = typing.get_type_hints(func, include_extras=True)
    out = {}
    for name, p in inspect.signature(func).parameters.items():
        opt = annotated_opt(hints.get(name))
        if opt is not None:
            out[name] = (opt, p.default)
    return out


def check_value(name: str, value: Any, opt: Opt) -> Any:
    """``value`` checked against ``opt.type`` (its range or choices; a whole number is never a bool); a one-line
    ``UserError`` naming ``name`` otherwise. None passes (an unset option)."""
    kind = opt.type
    if value is None or kind is None or isinstance(kind, click.Path):
        return value
    if isinstance(kind, click.IntRange) or kind is click.INT:
        low, high = getattr(kind, "min", None), getattr(kind, "max", None)
        bad = isinstance(value, bool) or not isinstance(value, int)
        if bad or (low is not None and value < low) or (high is not None and value > high):
            bound = (f" between {low} and {high}" if low is not None and high is not None
                     else f" >= {low}" if low is not None else f" <= {high}" if high is not None else "")
            raise UserError(f"{param(name)} must be a whole number{bound}, got {value!r}.")
        return value
    elif isinstance(kind, click.FloatRange) or kind is click.FLOAT or kind.name == "float":  # FiniteFloat too
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"{param(name)} must be a finite number, got {value!r}.")
    if isinstance(kind, click.Choice):
        for v in (value if opt.multiple and isinstance(value, (list, tuple)) else [value]):
            named = v in kind.choices or (not isinstance(v, str) and str(v) in kind.choices)  # IntChoice: "8"
            if isinstance(v, bool) or not named:
                raise UserError(f"{param(name)} must be one of {', '.join(map(str, kind.choices))}, got {v!r}.")
        return value
    values = value if opt.multiple and isinstance(value, (list, tuple)) else [value]
    try:
        for v in values:
            kind.convert(v, None, None)
    except click.BadParameter as e:
        raise UserError(f"{param(name)}: {e.message}") from None
    return value


def check_path(name: str, value: Any, opt: Opt) -> None:
    """A path option whose ``missing`` fix is set must exist when given (a one-line ``UserError`` naming it)."""
    if opt.missing is None or value is None:
        return
    for v in (value if isinstance(value, (list, tuple)) else [value]):
        if not os.path.exists(v):
            raise UserError(f"{param(name)} {v} does not exist; {opt.missing}.")


class Group:
    """An option group: a dataclass whose fields are options (:func:`option`). Built, it checks each field's
    value against its option (:func:`check_value`), then :meth:`validate` (the rules between fields)."""

    def __post_init__(self) -> None:
        self.check_fields()
        self.validate()

    def check_fields(self, kind: type | None = None) -> None:
        """Each field against its option (``kind``: only the fields whose type is one, e.g. ``click.IntRange``)."""
        for f in dataclasses.fields(self):
            opt = opt_of(f)
            if opt is not None and (kind is None or isinstance(opt.type, kind)):
                check_value(f.name, getattr(self, f.name), opt)

    def validate(self) -> None:
        """Rules between fields (a subclass overrides it); a one-line ``UserError``."""

    def check_paths(self) -> None:
        """Every path field that must exist does (called by the job, after its model is checked)."""
        for f in dataclasses.fields(self):
            opt = opt_of(f)
            if opt is not None:
                check_path(f.name, getattr(self, f.name), opt)


__all__ = ["Group", "Opt", "annotated_opt", "check_path", "check_value", "job_opts", "opt_of", "option"]
