"""Messages and pair collectives as the trainer issues them: right after compute, on ranks that are all busy.

The ping-pong and idle collectives of ``comm.py`` miss what a training step pays on every
message: a pipeline receiver posts its receive early and blocks; the sender computes, then sends;
the receiver must be woken (docs/performance.md: 0.5–0.8 ms on average on a 2-core VM, against a
0.06–0.1 ms ping-pong), and with more ranks than cores it must wait for a core too. A tensor-
parallel pair computes, then all-reduces, and pays the other rank's late arrival.

Here the ranks form pairs (0, 1), (2, 3), … and every pair runs the pattern at once, so a 4-rank
measurement on 2 cores is what 4 training ranks sharing 2 cores get:

* ``p2p``: the receiver posts ``irecv`` and waits; the sender computes one GEMM, stamps
  ``time.perf_counter()`` (CLOCK_MONOTONIC, one clock for every process of the host) into the
  message and sends it; the delay is the receiver's clock when its wait returns minus the stamp.
* ``all_reduce``, ``all_gather``, ``reduce_scatter`` over the pair: both compute the same GEMM,
  then call the collective; its seconds on each rank, averaged over both.
* ``exchange``: both compute the GEMM, then each sends its buffer to the other and receives the
  other's at once (``isend`` + ``irecv``, both waited), as context parallelism's ring shifts its
  key/value blocks; the seconds from posting to both done, averaged over both ranks. On a 2-core VM
  it cost several times a one-way message (about 1.3 ms against 0.3 ms), which priced cp = 2 runs
  20-45% too fast.

Each is the mean over 40 repetitions (160 at the two smallest sizes; a slow wake-up on the critical path
costs its full length, so the mean, not the median) at the sizes of ``comm.py``, kept with their ``latency + bytes/bandwidth`` fit
(``comm.measured_cost``; bytes as ``comm.py`` counts them). A rank of an odd world with no partner computes
alongside.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from modelpar._compat import all_gather_single, reduce_scatter_single
from modelpar.calibrate.comm import measured_cost, sizes
from modelpar.calibrate.compute import sync
from modelpar.costmodel.profiles import BUSY_OPS
from modelpar.formulas import allgather_bytes, allreduce_bytes

__all__ = ["BUSY_OPS", "measure_busy", "pair_groups"]

SMALL_REPS = 4  # the two smallest sizes get this many times the repetitions: a step issues tens of such
# collectives (a t = 2 step: 21 all-reduces per micro-batch) and their times are heavy-tailed (mostly 0.4-0.6 ms,
# now and then several ms, on a 2-core VM), so 40 runs' mean of one moved between 1.3 and 2.0 ms
_WORK = 384  # the GEMM each rank runs before a message: 384³·2 ≈ 0.11 GFLOP, about 1 ms on one CPU core


def _wait(work: dist.Work | None) -> None:
    if work is not None:
        work.wait()


def _collective(op: str, group: object, full: torch.Tensor, shard: torch.Tensor) -> None:
    if op == "all_reduce":
        dist.all_reduce(full, group=group)
    elif op == "all_gather":
        all_gather_single(full, shard, group=group)
    else:
        reduce_scatter_single(shard, full, group=group)


def pair_groups() -> tuple[list[Any], int | None]:
    """The process groups of the pairs (0, 1), (2, 3), … (every rank creates every group, as group creation is
    collective) and the index of this rank's pair (None for the last rank of an odd world)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
    return pairs, rank // 2 if rank < 2 * len(pairs) else None


def measure_busy(device: torch.device, reps: int = 40) -> dict[str, list[Any]]:
    """op -> ``comm.measured_cost`` of ``BUSY_OPS`` over a pair while every pair runs the same (module docstring)."""
    rank = dist.get_rank()
    pairs, mine = pair_groups()
    peer = rank ^ 1
    x = torch.randn(_WORK, _WORK, device=device)
    measured = sizes(device)
    seconds = torch.zeros(len(BUSY_OPS), len(measured), dtype=torch.float64)
    for j, size in enumerate(measured):
        runs = reps * SMALL_REPS if j < 2 else reps  # the latency-bound sizes: heavy-tailed, and called most often
        for i, op in enumerate(BUSY_OPS):
            if op in ("p2p", "exchange"):
                buf = torch.zeros(size // 8, dtype=torch.float64, device=device)
                into = torch.zeros_like(buf)
            else:
                full = torch.ones(size // 8, dtype=torch.float64, device=device)
                shard = torch.ones(full.numel() // 2, dtype=torch.float64, device=device)
            total = 0.0
            for rep in range(runs + 1):  # the first is a warm-up
                dist.barrier()
                if mine is None:
                    x @ x
                    continue
                if op == "p2p":
                    if rank % 2:
                        _wait(dist.irecv(buf, peer))
                        took = time.perf_counter() - buf[0].item()
                    else:
                        x @ x
                        sync(device)  # a GPU's GEMM is done before the stamp
                        buf[0] = time.perf_counter()
                        _wait(dist.isend(buf, peer))
                        took = 0.0
                elif op == "exchange":
                    x @ x
                    sync(device)
                    t0 = time.perf_counter()
                    for work in (dist.isend(buf, peer), dist.irecv(into, peer)):
                        _wait(work)
                    took = (time.perf_counter() - t0) / 2
                else:
                    x @ x
                    sync(device)
                    t0 = time.perf_counter()
                    _collective(op, pairs[mine], full, shard)
                    took = (time.perf_counter() - t0) / 2  # the mean of the two ranks' (summed below)
                if rep > 0:
                    total += took
            seconds[i, j] = total / runs
    dist.all_reduce(seconds)  # per pair: the receiver's delay, the mean of the two ranks' collective
    return _fit(seconds / max(1, len(pairs)), measured)  # the mean over the pairs (each ran the same)


def _fit(seconds: torch.Tensor, measured: tuple[int, ...]) -> dict[str, list[Any]]:
    # every measured size is a whole number of float64 pairs
    sent = {"p2p": lambda n: n, "exchange": lambda n: n, "all_reduce": lambda n: allreduce_bytes(n, 2),
            "all_gather": lambda n: allgather_bytes(n, 2), "reduce_scatter": lambda n: allgather_bytes(n, 2)}
    return {op: measured_cost([(float(sent[op](size)), float(seconds[i, j])) for j, size in enumerate(measured)])
            for i, op in enumerate(BUSY_OPS)}
