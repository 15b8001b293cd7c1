"""The one exception type that reaches the user as a one-line message with exit code 2, and how messages name
the parameter at fault."""

from __future__ import annotations

import contextlib
import contextvars

_CLI_NAMES = contextvars.ContextVar("mlx_fun_cli_names", default=False)


class UserError(Exception):
    """A problem with the user's input: the message names the problem and the fix.

    The CLI prints ``Error: <message>`` and exits with status 2; nothing is written.
    """


def param(name: str) -> str:
    """How a message names job parameter ``name``: the flag (``--n-prune``) while the CLI runs the job, the
    keyword (``n_prune=``) when Python code calls it."""
    return "--" + name.replace("_", "-") if _CLI_NAMES.get() else f"{name}="


@contextlib.contextmanager
def cli_names():
    """Within the block, :func:`param` names flags (the CLI wraps every command in it)."""
    token = _CLI_NAMES.set(True)
    try:
        yield
    finally:
        _CLI_NAMES.reset(token)
