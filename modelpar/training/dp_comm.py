"""The data-parallel collectives of a step: started asynchronously, waited for once, counted and timed.

Each collective returns at once (``async_op=True``). On a GPU, NCCL runs it on its own stream,
which waits for the gradients the compute stream produced; ``wait`` only makes the compute
stream wait for it (the host does not block), so the backward kernels queued meanwhile overlap
with it, and the group's own timeout (the run's ``--timeout``) bounds it. On CPUs, gloo's threads
run it while this one computes, and ``wait`` gives up after the run's timeout.

What it records, for the accounting and the measured timeline:

- ``bytes_sent``: what this rank sends with ring algorithms (the cost model's convention,
  ``modelpar.costmodel.zero_bytes``): all-reduce 2(d-1)/d·n elements, reduce-scatter and all-gather
  (d-1)/d·n, n being the elements of the full flat buffer;
- ``spans``: (label, start, end) of each collective in this rank's step clock — from when it is
  issued (after the gradients it reads are computed) until it completes. On a GPU both ends are
  CUDA events; on a CPU a waiter thread stamps each completion as it happens.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from modelpar._compat import all_gather_single, reduce_scatter_single
from modelpar.pipeline.bounded_comm import FlightRecorder, is_nccl
from modelpar.pipeline.timing import CudaTimer, HostTimer

__all__ = ["REDUCTIONS", "DataParallelComm", "Pending"]

REDUCTIONS = ("all-reduce", "reduce-scatter")  # the labels of gradient reductions (all-gather: parameters)


@dataclass(eq=False)
class Pending:
    """One collective in flight."""

    label: str
    work: Any
    start: Any  # the timer's mark when it was issued
    end: Any = None  # CUDA: an event after it; CPU: perf_counter when it completed (the waiter's stamp)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class DataParallelComm:
    """Asynchronous collectives over the data-parallel ``group`` (None: d = 1, nothing to do)."""

    def __init__(self, group: Any, timer: HostTimer | CudaTimer, recorder: FlightRecorder, timeout: float) -> None:
        self.group, self.timer, self.recorder, self.timeout = group, timer, recorder, timeout
        self.size = dist.get_world_size(group) if group is not None else 1
        self.nccl = is_nccl(group)
        self.bytes_sent = 0.0  # since the last ``take_step``
        self.bytes_by_label: dict[str, float] = {}  # the same by collective ("all-gather", "reduce-scatter", ...)
        self.last_step_bytes: dict[str, float] = {}  # ``bytes_by_label`` of the last step, kept by ``take_step``
        self._spans: list[Pending] = []
        self._side: Any = torch.cuda.Stream() if self.nccl else None  # records the completion events
        self._queue: queue.Queue[Pending | None] | None = None
        self._thread: threading.Thread | None = None
        self._root = self  # the comm whose counts, timeline and waiter this one's collectives join

    def on(self, group: Any) -> DataParallelComm:
        """Collectives over another ``group`` (the replicas holding the same experts, docs/moe.md), counted,
        timed and waited for with this comm's: they appear in its ``take_step``."""
        if group is self.group:
            return self
        other = DataParallelComm(group, self.timer, self.recorder, self.timeout)
        other._root = self._root
        return other

    # --- issuing ------------------------------------------------------------------------------
    def all_reduce(self, flat: torch.Tensor, label: str = "all-reduce") -> Pending:
        """Sum ``flat`` over the group, in place."""
        return self._issue(label, dist.all_reduce(flat, group=self.group, async_op=True),
                           2 * (self.size - 1) / self.size * flat.numel() * flat.element_size())

    def reduce_scatter(self, flat: torch.Tensor, shard: torch.Tensor, label: str = "reduce-scatter") -> Pending:
        """``shard`` (rank r's 1/d of ``flat``, possibly a view into it) becomes the sum of that part over the group."""
        return self._issue(label, reduce_scatter_single(shard, flat, group=self.group, async_op=True),
                           (self.size - 1) / self.size * flat.numel() * flat.element_size())

    def all_gather(self, flat: torch.Tensor, shard: torch.Tensor, label: str = "all-gather") -> Pending:
        """``flat`` becomes every rank's ``shard`` in rank order (``shard`` may be its own part of ``flat``)."""
        return self._issue(label, all_gather_single(flat, shard, group=self.group, async_op=True),
                           (self.size - 1) / self.size * flat.numel() * flat.element_size())

    def _issue(self, label: str, work: Any, nbytes: float) -> Pending:
        root = self._root
        root.bytes_sent += nbytes
        root.bytes_by_label[label] = root.bytes_by_label.get(label, 0.0) + nbytes
        pending = Pending(label, work, self.timer.mark())
        root._spans.append(pending)
        if self.nccl:
            with torch.cuda.stream(root._side):  # an event that completes with the collective
                work.wait()
                pending.end = self.timer.mark()
            pending.done.set()
        else:
            root._waiter().put(pending)
        return pending

    # --- waiting ------------------------------------------------------------------------------
    def wait(self, pending: Pending) -> None:
        """Make what follows wait for ``pending`` (on a GPU: the current stream; on a CPU: this thread)."""
        if self.nccl:  # no timeout argument: with one NCCL's wait blocks the host (the group's own timeout holds)
            pending.work.wait()
            return
        if not pending.done.wait(self.timeout + 5.0):
            raise self.recorder.timeout(self.timeout, f"the data-parallel {pending.label}")
        if pending.error is not None:
            raise pending.error

    def _waiter(self) -> queue.Queue[Pending | None]:
        """The thread that waits for each CPU collective in issue order and stamps its completion."""
        if self._queue is None:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._wait_all, args=(self._queue,), daemon=True,
                                            name="modelpar-dp-waiter")
            self._thread.start()
        return self._queue

    def _wait_all(self, q: queue.Queue[Pending | None]) -> None:
        while (pending := q.get()) is not None:
            try:
                pending.work.wait(timeout=datetime.timedelta(seconds=self.timeout))
            except BaseException as err:  # handed to the training thread's wait
                pending.error = err
            pending.end = time.perf_counter()
            pending.done.set()

    def close(self) -> None:
        """Let the waiter thread end once it has waited for what it holds. It is not joined: after a
        failed step it may be waiting for a collective that never completes (it times out, and it
        is a daemon thread, so it never keeps the process alive)."""
        if self._queue is not None:
            self._queue.put(None)
            self._queue = self._thread = None

    # --- measuring ----------------------------------------------------------------------------
    def take_step(self) -> tuple[float, list[tuple[str, float, float]]]:
        """Bytes sent and (label, start, end) of each collective issued since the last call, in this
        rank's step clock; call after they were all waited for, before the next pipeline step."""
        nbytes, spans, self._spans, self.bytes_sent = self.bytes_sent, self._spans, [], 0.0
        self.last_step_bytes, self.bytes_by_label = self.bytes_by_label, {}
        if self.nccl and spans:
            self._side.synchronize()  # its completion events must have happened to be read
            times = self.timer.resolve([m for s in spans for m in (s.start, s.end)], self.timeout,
                                       lambda: self.recorder.timeout(self.timeout, "the data-parallel collectives"))
            return nbytes, [(s.label, times[2 * i], times[2 * i + 1]) for i, s in enumerate(spans)]
        return nbytes, [(s.label, float(s.start), float(s.end)) for s in spans]
