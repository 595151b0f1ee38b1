"""Waiting in tests: every wait has a deadline and stops as soon as what it waits on has died.

A test that waits for a file, a checkpoint or a process to end uses ``wait_until``; no test loops on
``sleep`` by itself. A CLI that dies early then fails the test at once with what it waited for, and a
run that never gets there fails at the deadline, not at CI's limit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

DEADLINE = 120.0  # seconds: minutes of slack for a tiny run on a loaded 2-core machine, well under pytest's timeout


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # the state field follows the command name
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_until(condition: Callable[[], T], what: str, *, alive: Callable[[], bool] | None = None,
               timeout: float = DEADLINE, poll: float = 0.01) -> T:
    """``condition()``'s first truthy value, polled every ``poll`` s.

    Fails with an AssertionError naming ``what`` once ``timeout`` seconds have passed, or as soon as
    ``alive()`` says the process that should bring it about is gone (after one last look).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if alive is not None and not alive():
            value = condition()  # it may have happened just before the exit
            if value:
                return value
            raise AssertionError(f"waited for {what}, but the process that was to bring it about has exited")
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g} s for {what}")
        time.sleep(poll)


def wait_gone(pids: Iterable[int], what: str, timeout: float = 10.0) -> None:
    """Wait until none of ``pids`` runs; fail naming ``what`` if one still does after ``timeout`` s."""
    pids = list(pids)
    wait_until(lambda: not any(map(pid_alive, pids)), f"{what} to exit (pids {pids})", timeout=timeout, poll=0.05)


def join(thread: threading.Thread, timeout: float = DEADLINE) -> None:
    """``thread.join()`` with a deadline: fail naming the thread if it is still running after ``timeout`` s."""
    thread.join(timeout)
    assert not thread.is_alive(), f"thread {thread.name} still running after {timeout:g} s"
