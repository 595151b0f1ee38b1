"""When each action of a step ran: host clock on CPUs, CUDA events on GPUs, resolved once per step.

On a GPU the host only queues kernels, so ``perf_counter`` around an action would measure the
queueing. ``CudaTimer`` records an event before and after each action on the current stream and
reads them all once, at the end of the step: ``t0 + elapsed(start event, event)``, where ``t0``
is the host clock when the step's start event was recorded on an idle stream (synchronised
once). Waiting for the events polls them with short sleeps, never a spinning core, and gives
up when none completes within the runner's timeout (``wait_for_events``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CudaTimer", "HostTimer", "timer_for", "wait_for_events"]


class HostTimer:
    """``time.perf_counter`` marks (seconds): exact for CPU compute, which runs as it is called."""

    def start_step(self) -> None:
        pass

    def mark(self) -> Any:
        return time.perf_counter()

    def resolve(self, marks: list[Any], timeout: float, on_timeout: Callable[[], BaseException]) -> list[float]:
        return marks


class CudaTimer:
    """CUDA event marks on the current stream, turned into this rank's host-clock seconds once per step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.t0 = 0.0
        self.start: Any = None

    def start_step(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()
        self.start = self.mark()
        self.t0 = time.perf_counter()

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def resolve(self, marks: list[Any], timeout: float, on_timeout: Callable[[], BaseException]) -> list[float]:
        wait_for_events([*marks, self.mark()], timeout, on_timeout)
        return [self.t0 + self.start.elapsed_time(e) / 1e3 for e in marks]


def wait_for_events(events: list[Any], timeout: float, on_timeout: Callable[[], BaseException],
                    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    """Wait until every event (in stream order) has completed; raise ``on_timeout()`` once ``timeout``
    seconds pass without one more completing.

    The host queues a whole step before it waits here, so the step may rightly take far longer
    than ``timeout``: what is bounded is the wait for the next action to finish, the same bound the
    runtime puts on every wait on CPUs. Polls with short sleeps, never a spinning core.
    """
    done, deadline, pause = 0, clock() + timeout, 1e-5
    while done < len(events):
        if events[done].query():
            done += 1
            deadline, pause = clock() + timeout, 1e-5
            continue
        if clock() > deadline:
            raise on_timeout()
        sleep(pause)
        pause = min(2 * pause, 1e-3)


def timer_for(device: torch.device) -> HostTimer | CudaTimer:
    """CUDA events for a GPU's stages, the host clock otherwise."""
    return CudaTimer(device) if device.type == "cuda" else HostTimer()
