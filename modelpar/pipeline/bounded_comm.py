"""The runtime's waits and collectives, each bounded by the runner's timeout and naming what hung.

torch's object collectives block for the group's own timeout (30 minutes for a gloo group built
by a DeviceMesh); these start asynchronous work and wait at most ``timeout`` seconds, so a peer
that died or hung becomes a ``TimeoutError`` on every rank within the runner's timeout, with the
``FlightRecorder``'s account of what this rank last did. ``group=None`` is a group of one: no
communication at all.

Under NCCL a wait on the host polls the work's completion with short sleeps (it never spins a
core); the step's point-to-point waits only order the CUDA streams and do not block the host.
"""

from __future__ import annotations

import datetime
import pickle
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from modelpar.schedules.replay import replay_times
from modelpar.schedules.schedule import Schedule

__all__ = ["FlightRecorder", "all_gather_object", "all_reduce_ints", "broadcast_object", "comm_device",
           "critical_path", "is_nccl", "step_timeout", "wait"]


def critical_path(schedule: Schedule) -> int:
    """The number of actions on the longest chain of a step: its length with every action costing 1
    and messages free (each action waits for its input and for the action before it on its device)."""
    _, ends = replay_times(schedule)
    return round(max((e for device in ends for e in device), default=0.0))


def step_timeout(schedule: Schedule, timeout: float) -> float:
    """The NCCL watchdog timeout of a pipeline group: ``timeout × (critical_path + 1)`` seconds.

    NCCL times every operation from when it was posted, and receives are posted early (at the
    start of a step, or just after the previous send: ``modelpar.schedules.lower``), so a receive
    may legitimately wait for most of a step. If one action and the message it sends take at
    most ``timeout`` (every wait of the runtime is bounded by it), a step's last message arrives
    within ``critical_path × timeout`` of its start, plus one ``timeout`` for the ranks starting the
    step at different times. docs/stopping.md states the rule.
    """
    return timeout * (critical_path(schedule) + 1)


def is_nccl(group: Any) -> bool:
    """True when ``group`` communicates over NCCL (a plain or a mixed "cpu:gloo,cuda:nccl" backend)."""
    return group is not None and "nccl" in str(dist.get_backend(group))


def comm_device(group: Any) -> torch.device:
    """Where this rank's communication buffers live: its current GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if is_nccl(group) else torch.device("cpu")


class FlightRecorder:
    """The last pipeline operations this rank issued, so that a timeout names where it stood.

    A compute operation is recorded when it has finished, a send or receive when it was posted.
    """

    def __init__(self, rank: int, group_rank: int, size: int = 8) -> None:
        self.where = f"rank {rank} (pipeline device {group_rank})"
        self.done: deque[str] = deque(maxlen=size)

    def issued(self, op: str) -> None:
        self.done.append(op)

    def timeout(self, seconds: float, what: str) -> TimeoutError:
        last = ", ".join(self.done) if self.done else "nothing yet"
        return TimeoutError(
            f"{self.where} waited {seconds:g} s for {what}; the last operations it issued: {last}. "
            "The peer failed or hung (its error names the cause)"
        )


def wait(work: Any, timeout: float, what: str, recorder: FlightRecorder, nccl: bool = False) -> None:
    """Block until ``work`` completes, or raise the recorder's TimeoutError naming ``what``."""
    if nccl:  # poll: NCCL's wait(timeout) is the watchdog's business, not ours
        deadline, pause = time.monotonic() + timeout, 1e-5
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise recorder.timeout(timeout, what)
            time.sleep(pause)
            pause = min(2 * pause, 2e-3)
        work.wait()
        return
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as err:  # gloo: "Timed out waiting ... for recv operation", "Operation timed out!"
        if "imed out" not in str(err) and "imeout" not in str(err):
            raise
        raise recorder.timeout(timeout, what) from None


def all_reduce_ints(values: list[int], group: Any, timeout: float, what: str, recorder: FlightRecorder) -> list[int]:
    """Element-wise sum of ``values`` over ``group``."""
    if group is None:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=comm_device(group))
    wait(dist.all_reduce(t, group=group, async_op=True), timeout, what, recorder, is_nccl(group))
    return [int(x) for x in t.tolist()]


def all_gather_object(obj: Any, group: Any, timeout: float, what: str, recorder: FlightRecorder) -> list[Any]:
    """Every rank's ``obj`` (picklable), in group-rank order."""
    if group is None:
        return [obj]
    device, nccl = comm_device(group), is_nccl(group)
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size(group))]
    wait(dist.all_gather(sizes, size, group=group, async_op=True), timeout, what, recorder, nccl)
    counts = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(counts), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    out = [torch.empty_like(padded) for _ in counts]
    wait(dist.all_gather(out, padded, group=group, async_op=True), timeout, what, recorder, nccl)
    return [pickle.loads(t[:n].cpu().numpy().tobytes()) for t, n in zip(out, counts)]


def broadcast_object(obj: Any, src: int, group: Any, timeout: float, what: str, recorder: FlightRecorder) -> Any:
    """Group rank ``src``'s ``obj`` on every rank (the others pass anything)."""
    if group is None:
        return obj
    device, nccl = comm_device(group), is_nccl(group)
    mine = dist.get_rank(group) == src
    data = pickle.dumps(obj) if mine else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    source = dist.get_global_rank(group, src)
    wait(dist.broadcast(size, source, group=group, async_op=True), timeout, what, recorder, nccl)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if mine
           else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
    wait(dist.broadcast(buf, source, group=group, async_op=True), timeout, what, recorder, nccl)
    return obj if mine else pickle.loads(buf.cpu().numpy().tobytes())
