"""Writing a command's output files so that a failed write is one line and leaves nothing half-written.

A full disk, a read-only file system or a missing permission raises ``OSError`` deep inside a
write; the commands turn it into a ``ValueError`` naming the file and the reason in words
(``output_error``), which the CLI prints as one line with exit code 2. ``write_file`` writes a
whole file through a temporary one renamed into place (a failure leaves the old file or none,
never a 0-byte or torn one); ``append_text`` adds to a file and, if the write fails, cuts it back
to the size it had (never a torn last line). Pure Python, no torch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from pathlib import Path

__all__ = ["append_text", "output_error", "why_failed", "write_file"]

_REASONS = {errno.ENOSPC: "no space left on device", errno.EROFS: "a read-only file system",
            errno.EACCES: "permission denied", errno.EPERM: "permission denied", errno.EDQUOT: "disk quota exceeded"}


def why_failed(err: OSError) -> str:
    """The reason of a failed file operation in words (``no space left on device``)."""
    return _REASONS.get(err.errno or 0, (err.strerror or str(err)).lower())


def output_error(what: str, path: str | os.PathLike, err: OSError) -> ValueError:
    """The one-line error for a failed write of ``what`` (``metrics``, ``the run summary``) to ``path``."""
    return ValueError(f"cannot write {what} {str(path)!r}: {why_failed(err)}")


def write_file(path: str | os.PathLike, data: str | bytes, what: str) -> None:
    """Replace ``path`` by ``data`` (text as UTF-8) at once: a failure leaves the previous file (or none)
    and raises ``output_error``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise output_error(what, path, err) from None


def append_text(path: str | os.PathLike, text: str, what: str) -> None:
    """Append ``text`` to ``path``: a failure cuts the file back to its previous size (no torn line) and
    raises ``output_error``."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            try:
                view = memoryview(text.encode("utf-8"))
                while view:  # unbuffered: nothing is left to be written when the file is closed
                    view = view[os.write(fd, view):]
            except OSError:
                os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)
    except OSError as err:
        raise output_error(what, path, err) from None
