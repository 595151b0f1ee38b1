"""One worker thread per pipeline stage: ``submit`` a function to a stage, ``receive`` its result.

The workers of the threaded ``Pipe`` (reference text §3.1, §3.3). PyTorch releases the GIL
inside its operators, so stages on different threads (or devices) compute at the same time. Three
things make it correct rather than merely fast (§3.3):

1. Grad mode and autocast are thread-local: the caller's state is captured at ``submit`` and set
   again around the function in the worker, so ``torch.no_grad()`` builds no graph in any stage.
2. An exception raised in a stage is caught in the worker and re-raised by ``receive`` unchanged:
   the same object, so the same type and message, with the worker's traceback kept.
3. The function runs later, on another thread: bind its values when creating it
   (``partial(run, module, batch)``), not through a closure over a loop variable.

``close()`` stops and joins every thread; no thread outlives it, also after a stage raised.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import torch

from modelpar._validate import check_int

__all__ = ["StageWorkers", "as_device"]

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


def as_device(name: str, value: Any) -> torch.device:
    """Return ``value`` as a ``torch.device``, or raise ValueError naming the argument."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{name} must be a torch device such as 'cpu' or 'cuda:0', got {value!r}") from err
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if (device.index or 0) >= count:
            raise ValueError(f"{name} is {value!r}, but this machine has {count} CUDA device(s)")
    elif device.type != "cpu":
        raise ValueError(f"{name} must be a 'cpu' or 'cuda' device, got {value!r}")
    return device


def _capture_state() -> tuple[bool, list[tuple[str, torch.dtype]]]:
    """The caller's grad mode and the autocast regions it is inside (both are thread-local)."""
    autocast = [(t, torch.get_autocast_dtype(t)) for t in _AUTOCAST_DEVICE_TYPES if torch.is_autocast_enabled(t)]
    return torch.is_grad_enabled(), autocast


def _worker_loop(device: torch.device, num_threads: int | None, tasks: queue.Queue, results: queue.Queue) -> None:
    """Run tasks until the ``None`` sentinel; each result is ``(True, value)`` or ``(False, exception)``."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if num_threads is not None:
        torch.set_num_threads(num_threads)  # per thread with PyTorch's OpenMP backend
    while True:
        task = tasks.get()
        if task is None:
            return
        fn, grad_enabled, autocast = task
        task = None
        result: tuple[bool, Any] | None
        try:
            with ExitStack() as stack:
                stack.enter_context(torch.set_grad_enabled(grad_enabled))
                for device_type, dtype in autocast:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype))
                result = (True, fn())
        except BaseException as exc:
            result = (False, exc)
        fn = None  # keep no reference to the last batch once it is handed over
        results.put(result)
        result = None


def _stop(tasks: list[queue.Queue], threads: list[threading.Thread]) -> None:
    """Send every worker the stop sentinel and join it (also run by the finalizer on garbage collection)."""
    for q in tasks:
        q.put(None)
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join()


class StageWorkers:
    """One daemon thread per stage; ``submit(stage, fn)`` then ``receive(stage)`` in the same order.

    ``devices[j]`` is stage j's device: a CUDA worker makes it the thread's current device.
    ``num_threads`` sets PyTorch's intra-op threads inside each worker, so that stages sharing CPU
    cores do not fight over them (``None`` leaves the default). Drive it from one thread.
    """

    def __init__(self, devices: Sequence[Any], num_threads: int | None = None) -> None:
        if isinstance(devices, (str, torch.device)) or not isinstance(devices, Sequence):
            raise ValueError(f"devices must be a list of devices, one per stage, got {devices!r}")
        if len(devices) == 0:
            raise ValueError("devices must name at least one device, got an empty list")
        self.devices = [as_device(f"devices[{j}]", d) for j, d in enumerate(devices)]
        if num_threads is not None:
            num_threads = check_int("num_threads", num_threads, minimum=1)
        self._tasks: list[queue.Queue] = [queue.Queue() for _ in self.devices]
        self._results: list[queue.Queue] = [queue.Queue() for _ in self.devices]
        self._pending = [0] * len(self.devices)
        self._closed = False
        self._threads = [
            threading.Thread(
                target=_worker_loop,
                args=(device, num_threads, self._tasks[j], self._results[j]),
                name=f"modelpar-stage-{j}",
                daemon=True,
            )
            for j, device in enumerate(self.devices)
        ]
        for thread in self._threads:
            thread.start()
        # Threads never hold a reference to self, so a forgotten close() still stops them.
        self._finalizer = weakref.finalize(self, _stop, self._tasks, self._threads)

    @property
    def threads(self) -> list[threading.Thread]:
        """The worker threads, stage order."""
        return list(self._threads)

    @property
    def num_stages(self) -> int:
        return len(self._threads)

    def _check_stage(self, stage: int) -> int:
        if self._closed:
            raise RuntimeError("StageWorkers is closed")
        return check_int("stage", stage, minimum=0, maximum=self.num_stages - 1)

    def submit(self, stage: int, fn: Callable[[], Any]) -> None:
        """Queue ``fn()`` on ``stage``'s thread under the caller's grad mode and autocast state."""
        stage = self._check_stage(stage)
        if not callable(fn):
            raise ValueError(f"fn must be callable with no arguments, got {fn!r}")
        grad_enabled, autocast = _capture_state()
        self._pending[stage] += 1
        self._tasks[stage].put((fn, grad_enabled, autocast))

    def receive(self, stage: int) -> Any:
        """Wait for ``stage``'s oldest submitted function and return its value, or re-raise its exception."""
        stage = self._check_stage(stage)
        if self._pending[stage] == 0:  # waiting here would hang forever
            raise RuntimeError(f"receive({stage}) without a pending submit({stage})")
        ok, value = self._results[stage].get()
        self._pending[stage] -= 1
        if ok:
            return value
        raise value  # the stage's own exception object; its traceback still holds the worker frames

    def close(self) -> None:
        """Stop and join every worker thread (waits for functions already submitted). Idempotent."""
        if not self._closed:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> StageWorkers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running"
        return f"StageWorkers(devices={[str(d) for d in self.devices]}, {state})"
