"""The error handling every command runs under (one line per failure, its exit status, a stderr that never fails
a run) and the printing helpers the commands share. Options are generated from the jobs: :mod:`.options`."""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import os
import sys

import click

from ..errors import UserError, cli_names


DEBUG_ENV = "MLX_FUN_DEBUG"


def debug_enabled() -> bool:
    """``mlx-fun --debug`` or ``MLX_FUN_DEBUG=1``: let unexpected exceptions show their traceback."""
    from ..core.env import flag

    if flag(DEBUG_ENV):
        return True
    ctx = click.get_current_context(silent=True)
    root = ctx.find_root() if ctx is not None else None
    return bool(root is not None and (root.obj or {}).get("debug"))


def _os_error_line(e: OSError) -> str:
    where = f" ({e.filename})" if e.filename else ""
    fix = {errno.ENOSPC: "free some space or write elsewhere", errno.EROFS: "choose a writable location",
           errno.EACCES: "check the permissions or choose another location",
           errno.EPERM: "check the permissions or choose another location",
           errno.ENOENT: "check the path", errno.EFBIG: "the file size limit (ulimit -f) was reached"}.get(
        e.errno, "check the path and the disk")
    return f"{e.strerror or e}{where}; {fix}."


def friendly_errors(fn):
    """One line on stderr for every failure, never a traceback (unless ``--debug`` / ``MLX_FUN_DEBUG=1``).

    ``UserError`` and I/O errors → ``Error: <message>``, exit 2. Ctrl-C → exit 130, SIGTERM / SIGHUP → 128 +
    the signal (outputs in progress are removed by :mod:`mlx_fun.core.writer` first). Anything else is a bug:
    ``Error: internal error ...``, exit 1.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with sparing_stderr():
            return _friendly(fn, args, kwargs)

    return wrapper


def _friendly(fn, args, kwargs):
    """:func:`friendly_errors`' body: ``fn`` run, each failure one line and its exit status."""
    from ..core.writer import Terminated

    try:
        with cli_names():
            return fn(*args, **kwargs)
    except UserError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(2)
    except OSError as e:
        if debug_enabled():
            raise
        click.echo(f"Error: {_os_error_line(e)}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("Interrupted; outputs not yet complete were removed.", err=True)
        sys.exit(130)
    except Terminated as e:
        click.echo(f"Interrupted by {e}; outputs not yet complete were removed.", err=True)
        sys.exit(128 + e.signum)
    except click.exceptions.ClickException:
        raise
    except Exception as e:  # noqa: BLE001 - a bug or a backend failure: one line, traceback on request
        if debug_enabled():
            raise
        detail = " ".join(str(e).split())[:300]
        click.echo(f"Error: internal error {type(e).__name__}: {detail} (run with `mlx-fun --debug` or "
                   f"{DEBUG_ENV}=1 for the traceback, and please report it).", err=True)
        sys.exit(1)


class _SparingRaw(io.RawIOBase):
    """File descriptor 2, written with ``os.write``; what cannot be written (stderr closed, full, a broken pipe)
    is dropped: nothing stays buffered to fail again at exit."""

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        try:
            return os.write(2, data)
        except OSError:
            return len(data)

    def isatty(self) -> bool:
        try:
            return os.isatty(2)
        except OSError:
            return False


class _Sparing:
    """Another ``sys.stderr`` (a test's capture, a caller's stream) that swallows the errors of writing to it."""

    def __init__(self, stream):
        self._wrapped = stream

    def write(self, text):
        try:
            return self._wrapped.write(text)
        except (OSError, ValueError):  # full, broken or closed
            return len(text)

    def flush(self) -> None:
        try:
            self._wrapped.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name):
        return getattr(self._wrapped, name)


@contextlib.contextmanager
def sparing_stderr():
    """While a command runs, status lines, warnings and progress bars on stderr can never fail it: a closed
    (``2>&-``), full (``2>/dev/full``) or broken stderr drops them, and the run completes with its own exit status.
    A closed descriptor 2 is first pointed at /dev/null, so no file the run opens can become "stderr"."""
    try:
        os.fstat(2)
    except OSError:
        null = os.open(os.devnull, os.O_WRONLY)
        if null != 2:
            os.dup2(null, 2)
            os.close(null)
    before = sys.stderr
    if before is None or before is sys.__stderr__:
        try:
            before is not None and before.flush()
        except (OSError, ValueError):
            pass
        sys.stderr = io.TextIOWrapper(_SparingRaw(), encoding="utf-8", errors="backslashreplace",
                                      line_buffering=True, write_through=True)
    else:
        sys.stderr = _Sparing(before)
    try:
        yield
    finally:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        sys.stderr = before


def echo_err(line: str) -> None:
    """Status lines and warnings go to stderr (stdout carries the results)."""
    click.echo(line, err=True)


def fmt_number(x: float) -> str:
    return f"{x:.6g}"


def text_table(headers: list[str], rows: list[list[str]], indent: str = "  ", align: str = "") -> str:
    """Aligned text table; ``align`` has one 'l' or 'r' per column (missing: right-aligned, for numbers)."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells):
        return indent + "  ".join(c.ljust(w) if align[i:i + 1] == "l" else c.rjust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in rows])


def echo_warnings(messages: list[str]) -> None:
    for msg in messages:
        click.echo(f"Warning: {msg}", err=True)
