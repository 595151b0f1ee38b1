"""Small file systems for tests that must fill a disk or meet a read-only one: a tmpfs mount.

Mounting needs root (CI containers run as root); elsewhere the tests that need one are skipped,
and say so.
"""

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "4m", read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` for the block (read-only: empty and unwritable)."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited or read-only tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def resize(path: Path, size: str) -> None:
    """Change a mounted tmpfs's size (down to what it holds, or up)."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)


def used(path: Path) -> int:
    """Bytes in use on the file system at ``path``."""
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize
