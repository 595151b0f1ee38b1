"""When each action of a step ran: host clock on CPUs, CUDA events on GPUs, resolved once per step.

On a GPU the host only queues kernels, so ``perf_counter`` around an action would measure the
queueing. ``CudaTimer`` records an event before and after each action on the current stream and
reads them all once, at the end of the step: ``t0 + elapsed(start event, event)``, where ``t0``
is the host clock when the step's start event was recorded on an idle stream (synchronised
once). Waiting for the last event polls it with short sleeps, never a spinning core, and gives
up after the runner's timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CudaTimer", "HostTimer", "timer_for"]


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
        end = self.mark()
        deadline, pause = time.monotonic() + timeout, 1e-5
        while not end.query():
            if time.monotonic() > deadline:
                raise on_timeout()
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        return [self.t0 + self.start.elapsed_time(e) / 1e3 for e in marks]


def timer_for(device: torch.device) -> HostTimer | CudaTimer:
    """CUDA events for a GPU's stages, the host clock otherwise."""
    return CudaTimer(device) if device.type == "cuda" else HostTimer()
