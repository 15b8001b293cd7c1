"""The one atomic writer: every file and directory mlx-fun writes goes through :func:`output`.

``with output(path, kind=..., inputs=..., force=...) as res:`` reserves ``path`` *before* the work starts and
writes it only when the block succeeds:

1. **Refuses** an output that is an input, lies inside an input, or contains one — every file an input consists
   of counts where its symbolic links lead (the Hugging Face cache's ``snapshots/<rev>/f → ../../blobs/<hash>``)
   — so ``--force``, which replaces the output, can never delete a model, saliency file, dataset or expert
   list; the current directory or one of its parents, the home directory and the filesystem root; an existing
   file or non-empty directory without ``force`` (the one rule for every output); whatever ``force`` says, a
   symbolic link, a path that is not a regular file where a file is wanted (a device, a FIFO, a socket) and
   one that is not a directory where a directory is wanted.
2. **Locks** the output (``fcntl.flock`` on ``.<name>.lock`` beside it, which appears with its holder's pid in
   it: linked into place from a locked temp): a second run that names the same output fails at once with a
   one-line error naming that pid instead of silently replacing the first run's result.
3. **Cleans** temp entries of its own naming beside the output left by killed runs (``.<name>.mlxfun-*.tmp``,
   ``.<name>.old-*``): under the lock nobody else can own them. One notice line each.
4. **Proves** the location writable by creating the temp sibling (``res.tmp``) right away, so a read-only or
   missing location fails before hours of work; :meth:`Reservation.require_space` checks free space against an
   estimate as soon as the caller knows one.
5. On success renames the temp into place (the old output, with ``force``, is swapped out and removed; without
   it a file that appeared meanwhile is never replaced: the temp is hard-linked into place); on any
   exception, on SIGTERM / SIGHUP (turned into :class:`Terminated` while the block runs) and on Ctrl-C it
   removes the temp, the lock and any parent directory it created: the output is absent or complete. A block that
   decides against writing calls :meth:`Reservation.discard`: it ends like a failure, without one.

Everything is created with the user's umask (0644 files / 0755 directories under umask 022), unlike
``tempfile``'s private 0600 / 0700. SIGKILL cannot be caught; its temp is removed by the next run that writes
the same output. Writes are atomic against interruption of the process; file outputs are also fsync'ed.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import stat
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from ..errors import UserError, param
from .output_lock import NO_HARD_LINKS, TOKEN, acquire, locked_by_someone, signals_blocked
from .paths import mode_kind

_SPACE_MARGIN = 16 * 2**20  # bytes kept free beyond the estimate (metadata, tokenizer files, filesystem slack)


class Terminated(BaseException):
    """SIGTERM / SIGHUP received while an output was being written (the temp is removed before it propagates)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    def __str__(self) -> str:
        return signal.Signals(self.signum).name


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _stderr_notice(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ job inputs
#: the paths the running job reads, by how messages name them (``--model``): every reservation checks its output
#: against them, so an option that reads a file cannot be forgotten by the job that writes
_JOB_INPUTS: contextvars.ContextVar[dict[str, object]] = contextvars.ContextVar("mlx_fun_job_inputs", default={})
@contextlib.contextmanager
def reading(paths: Mapping[str, object]) -> Iterator[None]:
    """Within the block, every output reserved is also checked against ``paths`` (``{"--model": path, ...}``; a
    value may be a list): :func:`mlx_fun.jobs.common.job_inputs` sets them around each job's run."""
    token = _JOB_INPUTS.set(dict(paths))
    try:
        yield
    finally:
        _JOB_INPUTS.reset(token)


# ------------------------------------------------------------------------------------------ path checks
def _resolve(path: str | os.PathLike) -> Path:
    return Path(os.path.abspath(os.path.expanduser(os.fspath(path)))).resolve()


def _linked_targets(root: Path) -> Iterator[tuple[Path, Path]]:
    """``(entry, resolved target)`` for every symbolic link at any depth under the directory ``root`` (resolved),
    following linked directories once each: what the input really consists of beyond its own tree."""
    seen, todo = {root}, [root]
    while todo:
        top = todo.pop()
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_symlink():
                    target = Path(entry.path).resolve()
                    yield Path(entry.path), target
                    if target.is_dir() and target not in seen:
                        seen.add(target)
                        todo.append(target)
                elif entry.is_dir(follow_symlinks=False):
                    todo.append(Path(entry.path))
            except (OSError, RuntimeError):  # a link loop or an unreadable entry: the job's reader says so
                continue


def _check_input(out: Path, path, flag: str, label: str, inp) -> None:
    """Refuse ``out`` if it is, lies inside or contains the input ``inp`` or a target of a link inside it."""
    src = _resolve(inp)
    shown = f"{flag} {path}"
    links = ((target, f"its {entry.relative_to(src) if entry.is_relative_to(src) else entry} is a link to {target}")
             for entry, target in (_linked_targets(src) if src.is_dir() else ()))
    for target, via in itertools.chain([(src, None)], links):
        where = f" ({via})" if via else ""
        if out == target:
            what = f"the input given to {label}" if via is None else f"a file of the input {label} {inp}"
            raise UserError(f"{shown} is {what}{where}; write the result somewhere else.")
        if target in out.parents:
            raise UserError(f"{shown} is inside the input {label} {inp}{where}; write the result somewhere else.")
        if out in target.parents:
            raise UserError(f"{shown} contains the input {label} {inp}{where}; replacing it would delete that input, "
                            f"so write the result to a new path.")


def _resolve_output(plain: Path, shown: str) -> tuple[Path, os.stat_result | None]:
    """``plain`` resolved and its ``stat`` (None: missing or unreachable, which reserving it then says)."""
    try:
        out = plain.resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: Python's word for a loop of links
        if isinstance(e, RuntimeError) or e.errno == errno.ELOOP:
            raise UserError(f"{shown} lies behind a loop of symbolic links; choose another path.") from None
        out = plain
    try:
        return out, os.stat(out)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(f"{shown} lies behind a loop of symbolic links; choose another path.") from None
        return out, None


def check_output_path(path: str | os.PathLike, *, kind: str, inputs: Mapping[str, object] | None = None,
                      force: bool = False, flag: str | None = None, force_flag: str | None = None) -> Path:
    """Raise a one-line ``UserError`` if writing ``path`` could lose data or cannot work; return it resolved.

    ``inputs`` maps a flag name (``--model``) to a path or a list of paths (None entries are ignored); the
    paths the running job reads (:func:`reading`) are added to them. An existing output (a file, a non-empty
    directory) is refused unless ``force`` (named ``force_flag`` in the message, default ``--force``; ``""``:
    there is no way to force, pick another name); a symbolic link, and what is not a regular file (a
    directory) where a file (a directory) is wanted, are refused whatever ``force`` says.
    """
    if kind not in ("file", "dir"):
        raise ValueError(f"kind must be 'file' or 'dir', not {kind!r}")
    flag = flag or param("output")
    if not os.fspath(path).strip():
        raise UserError(f"{flag} is empty; give a path to write to.")
    plain = Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    if plain.is_symlink():
        raise UserError(f"{flag} {path} is a symbolic link (to {os.readlink(plain)}); mlx-fun never replaces a link "
                        f"or writes through one: give the real path, or another path.")
    out, st = _resolve_output(plain, f"{flag} {path}")
    for label, value in {**_JOB_INPUTS.get(), **(inputs or {})}.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        for inp in values:
            if inp is not None and Path(os.path.expanduser(os.fspath(inp))).exists():
                _check_input(out, path, flag, label, inp)
    cwd, home = Path.cwd().resolve(), Path.home().resolve()
    if kind == "dir" and (out == cwd or out in cwd.parents or out == home or out.parent == out):
        what = "the current directory" if out == cwd else (
            "the home directory" if out == home else "a parent of the current directory")
        raise UserError(f"{flag} {path} is {what}; replacing it would delete everything in it. "
                        "Write to a new directory (e.g. ./result).")
    if st is None:
        return out
    forcing = force_flag if force_flag is not None else param("force")
    if kind == "dir":
        if not stat.S_ISDIR(st.st_mode):
            raise UserError(f"{flag} {path} exists and is not a directory; choose another path.")
        if any(out.iterdir()) and not force:
            raise UserError(f"{flag} {path} exists and is not empty; "
                            + (f"pass {forcing} to replace it, or pick another path." if forcing
                               else "choose another name so it is not replaced."))
        return out
    if stat.S_ISDIR(st.st_mode):
        raise UserError(f"{flag} {path} is a directory; give a file path such as {Path(path) / 'result'}.")
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{flag} {path} is {mode_kind(st.st_mode)}, not a regular file, and is never replaced; give "
                        f"the path of a new file.")
    if not force:
        raise UserError(f"{flag} {path} already exists; "
                        + (f"pass {forcing} to replace it, or pick another path." if forcing
                           else "choose another name so it is not replaced."))
    return out


def _stale_pattern(name: str) -> re.Pattern:
    """Temp entries a writer of ``name`` leaves when killed (plus the 8-character ``tempfile`` names of 0.1)."""
    n = re.escape(name)
    return re.compile(rf"^\.{n}\.(({TOKEN}[0-9a-f]{{8}}|[a-z0-9_]{{8}})\.tmp(\..+)?|old-\d+|lock\.{TOKEN}[0-9a-f]{{8}}\.tmp)$")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """While the block runs, SIGTERM and SIGHUP raise :class:`Terminated` (if their handler is the default)."""
    installed = {}
    if threading.current_thread() is threading.main_thread():
        def handler(signum, frame):
            raise Terminated(signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) == signal.SIG_DFL:
                installed[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, previous in installed.items():
            signal.signal(sig, previous)


# ------------------------------------------------------------------------------------------ reservation
class Reservation:
    """A reserved output: write into ``tmp`` (a directory, or a file path); it becomes ``path`` on success."""

    def __init__(self, path: Path, shown: str, kind: str, force: bool, flag: str, suffix: str,
                 notice: Callable[[str], None]):
        self.path, self.shown, self.kind, self.force, self.flag = path, shown, kind, force, flag
        self.suffix, self.notice = suffix, notice
        self.tmp: Path | None = None
        self._lock_fd: int | None = None
        self._lock_path = path.parent / f".{path.name}.lock"
        self._created_dirs: list[Path] = []
        self.discarded = False

    # -- setup
    def _open(self) -> None:
        try:
            self._make_parents()
            self._lock_fd = acquire(self._lock_path, self.flag, self.shown)
            self._clean_stale()
            name = f".{self.path.name}.{TOKEN}{secrets.token_hex(4)}.tmp{self.suffix}"
            tmp = self.path.parent / name
            # a SIGTERM between creating the temp and recording it would leave it behind: hold signals back
            # until ``self.tmp`` is set, so the Terminated it raises finds the temp to remove
            with signals_blocked():
                if self.kind == "dir":
                    os.mkdir(tmp, 0o777)
                else:
                    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666))
                self.tmp = tmp
        except OSError as e:
            raise UserError(f"cannot write {self.flag} {self.shown}: {e.strerror or e} ({e.filename or self.path.parent}); "
                            f"choose a writable location.") from None

    def _make_parents(self) -> None:
        missing = []
        parent = self.path.parent
        while not parent.exists():
            missing.append(parent)
            parent = parent.parent
        for d in reversed(missing):
            os.mkdir(d, 0o777)
            self._created_dirs.append(d)

    def _clean_stale(self) -> None:
        pattern = _stale_pattern(self.path.name)
        for entry in sorted(self.path.parent.iterdir()):
            if pattern.match(entry.name) and not locked_by_someone(entry):
                _remove(entry)
                self.notice(f"Removed {entry}, left behind by an interrupted run.")

    # -- during the work
    def require_space(self, nbytes: int, what: str = "the output") -> None:
        """``UserError`` unless the output's filesystem has room for ``nbytes`` (plus a small margin)."""
        free = shutil.disk_usage(self.path.parent).free
        if free < nbytes * 1.01 + _SPACE_MARGIN:
            raise UserError(f"not enough free space for {self.flag} {self.shown}: {what} needs about "
                            f"{fmt_bytes(nbytes)} and mlx-fun keeps {fmt_bytes(_SPACE_MARGIN)} more free (metadata, "
                            f"filesystem slack), {fmt_bytes(free)} is free there; free some space or write elsewhere.")

    def write_failed(self, exc: BaseException) -> UserError:
        """A one-line error for a failed write into ``tmp`` (e.g. MLX's ``[write] Unable to write``)."""
        free = shutil.disk_usage(self.path.parent).free
        detail = " ".join(str(exc).split())[:160]
        return UserError(f"writing {self.flag} {self.shown} failed ({detail}; {fmt_bytes(free)} free there); "
                         f"nothing was written.")

    def write_text(self, text: str) -> None:
        """Fill a file reservation's temp with ``text`` (UTF-8)."""
        self.tmp.write_text(text, encoding="utf-8")

    def write_json(self, obj) -> None:
        self.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")

    def discard(self) -> None:
        """End the block without writing ``path`` (what is there stays as it was): the work decided against it."""
        self.discarded = True

    # -- the end
    def _commit(self) -> None:
        assert self.tmp is not None
        try:
            if self.kind == "file":
                with open(self.tmp, "rb+") as f:
                    os.fsync(f.fileno())
                if self.force:
                    os.replace(self.tmp, self.path)
                else:
                    _place_new(self.tmp, self.path)
                _fsync_dir(self.path.parent)
            elif self.path.is_dir() and self.force and any(self.path.iterdir()):
                old = self.path.parent / f".{self.path.name}.old-{os.getpid()}"
                os.rename(self.path, old)
                os.rename(self.tmp, self.path)
                _remove(old)
            else:
                os.rename(self.tmp, self.path)  # fails if a non-empty directory appeared meanwhile
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise UserError(f"{self.flag} {self.shown} was created by something else during this run; "
                                f"nothing was written. Pass {param('force')} to replace it, or pick another path.") from None
            raise UserError(f"could not move the result into {self.flag} {self.shown}: {e.strerror or e}; "
                            f"nothing was written.") from None
        self.tmp = None

    def _release(self) -> None:
        if self.tmp is not None:
            _remove(self.tmp)
            self.tmp = None
        if self._lock_fd is not None:
            with contextlib.suppress(FileNotFoundError):
                self._lock_path.unlink()
            os.close(self._lock_fd)
            self._lock_fd = None
        for d in reversed(self._created_dirs):
            if not self.path.exists():
                with contextlib.suppress(OSError):
                    d.rmdir()  # only if still empty


def _place_new(tmp: Path, path: Path) -> None:
    """Move ``tmp`` to ``path`` unless something is there (``FileExistsError``): a hard link fails rather than
    replace; where the filesystem has none, a check right before the rename."""
    try:
        os.link(tmp, path)
    except OSError as e:
        if e.errno not in (*NO_HARD_LINKS, errno.EXDEV):
            raise
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path)) from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def output(path: str | os.PathLike, *, kind: str = "file", inputs: Mapping[str, object] | None = None,
           force: bool = False, flag: str | None = None, suffix: str = "",
           notice: Callable[[str], None] | None = None, force_flag: str | None = None) -> Iterator[Reservation]:
    """Reserve ``path`` now and write it atomically when the block succeeds (see the module docstring).

    ``kind`` is ``"file"`` (write to ``res.tmp``, a file path ending in ``suffix``) or ``"dir"`` (fill the
    directory ``res.tmp``). An existing output (a file, a non-empty directory) is replaced only with ``force``
    (named ``force_flag`` in the message: :func:`check_output_path`). ``inputs`` adds to the paths the running job
    reads (:func:`reading`), all refused as or around the output.
    """
    shown = os.fspath(path)
    flag = flag or param("output")
    target = check_output_path(path, kind=kind, inputs=inputs, force=force, flag=flag, force_flag=force_flag)
    res = Reservation(target, shown, kind, force, flag, suffix, notice or _stderr_notice)
    with _signals_raise():
        try:
            res._open()
            try:
                yield res
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):  # the output's disk: say which output
                    raise res.write_failed(e) from None
                raise
            if not res.discarded:
                with signals_blocked():
                    res._commit()
        finally:
            with signals_blocked():
                res._release()


# ------------------------------------------------------------------------------------------ small files
def write_text(path: str | os.PathLike, text: str, *, inputs: Mapping[str, object] | None = None,
               flag: str | None = None, force: bool = False, force_flag: str | None = None) -> Path:
    """Write a text file atomically (UTF-8); an existing one only with ``force``."""
    with output(path, kind="file", inputs=inputs, flag=flag, force=force, force_flag=force_flag) as res:
        res.write_text(text)
    return Path(path)


def write_json(path: str | os.PathLike, obj, *, inputs: Mapping[str, object] | None = None,
               flag: str | None = None, force: bool = False, force_flag: str | None = None) -> Path:
    """Write JSON atomically; an existing file only with ``force``."""
    with output(path, kind="file", inputs=inputs, flag=flag, force=force, force_flag=force_flag) as res:
        res.write_json(obj)
    return Path(path)
