"""One writer per checkpoint directory: ``root/LOCK``, held with ``flock`` for the life of a run.

The file says who holds it (host, pid, start time); the kernel's ``flock`` says whether that
holder is still alive: it is released when the holding process exits, however it exits. So a
``LOCK`` file nobody holds is stale (its run was killed) and is taken over with a warning, one
held by a live process refuses the second run, naming the holder. A stale file written on another
host is refused too, since its process cannot be looked up from here: delete it by hand.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any

from modelpar._outputs import output_error

__all__ = ["LOCK", "DirLock", "check_unlocked", "lock_holder"]

LOCK = "LOCK"


def _describe(holder: dict[str, Any]) -> str:
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} (since {holder.get('started', '?')})"


def _read(path: Path) -> dict[str, Any]:
    try:
        holder = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _in_use(root: Path, holder: str, what: str = "checkpoint directory") -> ValueError:
    article = "an" if what[0] in "aeiou" else "a"
    return ValueError(f"{what} {str(root)!r} is in use by {holder}: one run writes {article} {what} at a time")


def lock_holder(root: str | os.PathLike, name: str = LOCK) -> str | None:
    """Who holds the lock ``name`` on ``root`` right now (a description), or None if nobody does."""
    path = Path(root) / name
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):  # no lock; or no such directory (a file on the way)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _describe(_read(path))
    finally:
        os.close(fd)  # also drops the shared lock taken to probe
    return None


def check_unlocked(root: str | os.PathLike, name: str = LOCK, what: str = "checkpoint directory") -> None:
    """ValueError naming the holder if a live process holds the lock on ``root`` (a check before starting)."""
    holder = lock_holder(root, name)
    if holder is not None:
        raise _in_use(Path(root), holder, what)


class DirLock:
    """An exclusive lock on directory ``root`` (a checkpoint directory; ``name``, ``what``: another kind
    of folder, e.g. ``train --out``): ``acquire`` before writing, ``release`` after."""

    def __init__(self, root: str | os.PathLike, name: str = LOCK, what: str = "checkpoint directory") -> None:
        self.root, self.what = Path(root), what
        self.path = self.root / name
        self._fd: int | None = None

    def acquire(self) -> str:
        """Take the lock; return a warning if a stale one was taken over (else "").

        ValueError naming the holder if a live process holds it, or if a stale one was written on another host.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise _in_use(self.root, _describe(_read(self.path)), self.what) from None
            try:
                same_file = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:  # its holder released and removed it between our open and flock
                same_file = False
            if same_file:
                break
            os.close(fd)
        previous = _read(self.path)
        host = socket.gethostname()
        if previous and previous.get("host") != host:
            os.close(fd)
            raise ValueError(f"{self.what} {str(self.root)!r} has a lock from {_describe(previous)}, another "
                             f"host: if that run has ended, delete {str(self.path)!r}")
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        try:
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"host": host, "pid": os.getpid(), "started": started}).encode())
            os.fsync(fd)
        except OSError as err:  # a full or read-only disk: no lock left behind (an empty one would say nothing)
            self.path.unlink(missing_ok=True)
            os.close(fd)
            raise output_error("the lock", self.path, err) from None
        self._fd = fd
        return f"took over the stale lock of {_describe(previous)}, which is no longer running" if previous else ""

    def release(self) -> None:
        """Remove the lock file and let go (a no-op if not held)."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
