"""The output lock of :mod:`mlx_fun.core.writer`: ``.<name>.lock`` beside an output, held with ``fcntl.flock`` for as
long as a run writes that output, and never seen without its holder's pid in it (a second run names that pid).

:func:`acquire` links a locked temp holding the pid into place (``link`` fails if a lock exists), takes over a lock
whose holder is gone (its ``flock`` released, e.g. killed), and on a filesystem without hard links falls back to
locking the lock file in place. :func:`signals_blocked` holds SIGTERM / SIGHUP / SIGINT back around steps that
must not be cut short (here and in the writer's cleanup).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from ..errors import UserError

#: the mark of every temp entry mlx-fun's writer makes (``.<name>.mlxfun-XXXXXXXX.tmp``), lock temps included
TOKEN = "mlxfun-"


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
    """Hold back SIGTERM / SIGHUP / SIGINT while cleaning up, so the cleanup itself is not cut short."""
    sigs = {signal.SIGTERM, signal.SIGHUP, signal.SIGINT}
    main = threading.current_thread() is threading.main_thread()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs) if main else None
    try:
        yield
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def locked_by_someone(entry: Path) -> bool:
    """Whether ``entry`` is the locked pid temp of a run taking the lock right now (not a killed run's)."""
    if not entry.name.endswith(".tmp") or ".lock." not in entry.name:
        return False
    try:
        fd = os.open(entry, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


#: what ``link`` says on a filesystem without hard links (some FUSE, SMB and FAT mounts)
NO_HARD_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK)


def acquire(lock_path: Path, flag: str, shown: str) -> int:
    """An exclusive ``flock`` on ``lock_path``; a ``UserError`` naming the holder's pid if another run has it.

    The lock never exists without its holder's pid in it: the pid is written into a temp sibling that is
    locked first and then hard-linked into place (``link`` fails if a lock exists), so a second run reads a
    pid, never an empty file. A lock whose holder is gone (its ``flock`` released, e.g. killed) is taken over
    by renaming our locked temp onto it while holding its ``flock``. Without hard links: :func:`_lock_in_place`."""
    with signals_blocked():  # no interruption between creating our temp and removing its name
        while True:
            mine = lock_path.parent / f"{lock_path.name}.{TOKEN}{secrets.token_hex(4)}.tmp"
            try:
                fd = os.open(mine, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            except OSError as e:  # name the place, not our temp's name
                raise OSError(e.errno, e.strerror, str(lock_path.parent)) from None
            linked = False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else knows this file yet
                with contextlib.suppress(OSError):  # the pid informs a second run's message only; a full disk
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # is no reason to fail here
                linked = _link_or_take_over(mine, lock_path, flag, shown)
            except BaseException:
                os.close(fd)
                raise
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(mine)
            if linked:
                return fd
            os.close(fd)
            if linked is None:
                return _lock_in_place(lock_path, flag, shown)
            # a holder just finished, or our temp was taken as a killed run's: once more


def _held(fd: int, flag: str, shown: str) -> UserError:
    """The one-line refusal for a lock another run (or another request of this server) holds: its pid."""
    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
    if holder == str(os.getpid()):
        return UserError(f"{flag} {shown} is being written by another request of this server, which is saving "
                         f"there now; wait for it to finish or choose another path.")
    return UserError(f"{flag} {shown} is being written by another mlx-fun run (pid {holder}); wait for it to "
                     f"finish or choose another path.")


def _link_or_take_over(mine: Path, lock_path: Path, flag: str, shown: str) -> bool | None:
    """Make the locked ``mine`` the lock: True when it is, False to start again, None where the filesystem has no
    hard links; a ``UserError`` if another run holds it."""
    try:
        os.link(mine, lock_path)
        return True
    except FileExistsError:
        pass
    except FileNotFoundError:  # our temp was removed as a killed run's leftover before we locked it
        return False
    except OSError as e:
        if e.errno in NO_HARD_LINKS:
            return None
        raise
    try:
        other = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:  # its holder just released it
        return False
    try:
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _held(other, flag, shown) from None
        if not _still_the_lock(lock_path, other):  # unlinked by a finishing holder meanwhile
            return False
        os.replace(mine, lock_path)  # its holder is gone; only the holder of its flock (us) replaces or removes it
        return True
    finally:
        os.close(other)


def _still_the_lock(lock_path: Path, fd: int) -> bool:
    try:
        return os.stat(lock_path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _lock_in_place(lock_path: Path, flag: str, shown: str) -> int:
    """The lock on a filesystem without hard links: the lock file itself is created, locked, then given the pid
    (a second run in between reads no pid and says "pid ?")."""
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            error = _held(fd, flag, shown)
            os.close(fd)
            raise error from None
        if _still_the_lock(lock_path, fd):
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)
