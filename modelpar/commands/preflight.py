"""Checks ``modelpar train`` makes before it starts any rank: paths it must write, and the output lock.

Each failure is one line (a ValueError): an ``--out`` that is a file or cannot be written, a
``--checkpoint-dir`` under a file or on a read-only file system, a token cache that cannot be
created. ``out_lock`` gives ``--out`` one run at a time, as ``LOCK`` does a checkpoint directory,
so two runs never interleave one ``metrics.jsonl``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["OUT_LOCK", "check_paths", "check_writable", "out_lock"]

OUT_LOCK = ".modelpar-out.lock"  # in --out, held by the launching process (under torchrun: global rank 0)


def check_writable(flag: str, path: str | os.PathLike, what: str = "a folder") -> None:
    """ValueError in one line if folder ``path`` cannot be created or written by this process."""
    path = Path(path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{flag} {str(path)!r} is a file: give {what} to write in")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {str(path)!r} is not writable ({_why(path)})")
        return
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {str(path)!r} cannot be created: {str(parent)!r} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {str(path)!r} cannot be created: {str(parent)!r} is not writable ({_why(parent)})")


def _why(path: Path) -> str:
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "a read-only file system"
    except OSError:
        pass
    return "permission denied"


def check_paths(cfg: Any, out: str) -> None:
    """Every folder the run will write: ``--out``, ``--checkpoint-dir`` and the token cache."""
    from modelpar.text.prepare import cache_root

    check_writable("--out", out)
    if cfg.checkpoint_dir:
        check_writable("--checkpoint-dir", cfg.checkpoint_dir)
    cache = cache_root(cfg)
    check_writable("--cache-dir" if cfg.data.cache_dir else "the token cache (--cache-dir)", cache)


@contextlib.contextmanager
def out_lock(out: str, first: bool = True) -> Iterator[None]:
    """Hold ``--out``'s lock for the block (``first``: the process that writes it; others pass through).

    A second run on the same ``--out`` is refused in one line naming the holder; a folder this
    run created and left empty (a refusal before training) is removed again.
    """
    if not first:
        yield
        return
    from modelpar.checkpoint import DirLock

    folder = Path(out)
    created = not folder.exists()
    lock = DirLock(folder, OUT_LOCK, what="output folder (--out)")
    try:
        lock.acquire()
    except ValueError:
        if created:
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    try:
        yield
    finally:
        lock.release()
        if created:
            with contextlib.suppress(OSError):  # not empty: the run wrote its results
                folder.rmdir()
