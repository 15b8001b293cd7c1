"""The one exception type that reaches the user as a one-line message with exit code 2, and how messages name
the parameter at fault."""

from __future__ import annotations

import contextlib
import contextvars
import os

_CLI_NAMES = contextvars.ContextVar("mlx_fun_cli_names", default=False)


class UserError(Exception):
    """A problem with the user's input: the message names the problem and the fix.

    The CLI prints ``Error: <message>`` and exits with status 2; nothing is written.
    """


def param(name: str) -> str:
    """How a message names job parameter ``name``: the flag (``--n-prune``) while the CLI runs the job, the
    keyword (``n_prune=``) when Python code calls it."""
    return "--" + name.replace("_", "-") if _CLI_NAMES.get() else f"{name}="


def require_whole(name: str, value, low: int, *, none_ok: bool = False) -> None:
    """A one-line ``UserError`` naming parameter ``name`` unless ``value`` is a whole number (not a bool) >= ``low``
    (or None, with ``none_ok``)."""
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UserError(f"{param(name)} must be a whole number >= {low}, got {value!r}.")


def require_path(name: str, path, what: str = "check the path") -> None:
    """A one-line ``UserError`` naming parameter ``name`` when ``path`` is given but does not exist."""
    if path is not None and not os.path.exists(path):
        raise UserError(f"{param(name)} {path} does not exist; {what}.")


@contextlib.contextmanager
def cli_names():
    """Within the block, :func:`param` names flags (the CLI wraps every command in it)."""
    token = _CLI_NAMES.set(True)
    try:
        yield
    finally:
        _CLI_NAMES.reset(token)
