"""No process outlives the one that started it: the ranks' side of a launcher's death, even by ``kill -9``.

A ``LocalCluster`` rank holds the read end of a pipe only the launcher writes to (``exit_when_closed``);
a torchrun worker watches its parent, the agent (``exit_with_parent``). Either exits the moment
the launcher is gone, so no rank trains on, or writes a checkpoint, after it. That exit comes from
a thread, so it may lag the death by a thread switch; a rank about to make a write visible (seal,
publish or prune a checkpoint) asks ``end_if_orphaned`` first, which exits at once if the
launcher is gone: a save in progress at the launcher's ``kill -9`` is abandoned, never published.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["SCHEDULER_SIGNALS", "end_if_orphaned", "exit_when_closed", "exit_with_parent", "launcher_gone",
           "name_process"]

# Signals a scheduler may send to every process of a job to ask for a checkpoint (Slurm --signal,
# Kubernetes, `kill -TERM -- -PGID`). The forkserver ignores them (see modelpar.distributed._forkserver);
# the ranks start with them at their defaults and the training loop decides what they mean.
SCHEDULER_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_PR_SET_NAME = 15
_WATCHED: list[Callable[[], bool]] = []  # this process's launcher checks: each True once its launcher is gone


def launcher_gone() -> bool:
    """Whether this rank's launcher has died (False in a process without one: a test, a library call)."""
    return any(gone() for gone in _WATCHED)


def end_if_orphaned() -> None:
    """Exit at once (code 1) if this rank's launcher has died: called before a write becomes visible."""
    if launcher_gone():
        os._exit(1)


def name_process(name: str) -> None:
    """Show this process as ``name`` (15 bytes at most) in ps, top and /proc/PID/comm (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def exit_with_parent() -> None:
    """End this process as soon as the process that started it (torchrun's agent) is gone, even by ``kill -9``.

    Linux: the kernel sends SIGKILL when the parent exits (``prctl(PR_SET_PDEATHSIG)``); everywhere,
    a thread also watches for the parent to change and exits then.
    """
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)
    _WATCHED.append(lambda: os.getppid() != parent)
    threading.Thread(target=_exit_when_reparented, args=(parent,), name="modelpar-parent-watch", daemon=True).start()


def _exit_when_reparented(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def exit_when_closed(lifeline: Any) -> None:
    """Block until the launcher's end of the lifeline pipe closes (it died, or closed the cluster), then exit."""
    watch(lifeline)
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv_bytes()
    os._exit(1)


def watch(lifeline: Any) -> None:
    """Count ``lifeline`` (the read end of a pipe only the launcher holds open) in ``launcher_gone``:
    the launcher never writes to it, so it turns readable only at end of file, when the launcher is gone."""
    def closed() -> bool:
        try:
            return bool(lifeline.poll(0))
        except (EOFError, OSError):
            return True
    _WATCHED.append(closed)
