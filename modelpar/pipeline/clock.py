"""One clock for a pipeline group, so that events measured on different ranks can be compared.

On one machine ``time.perf_counter`` is the kernel's monotonic clock, the same in every process:
the offset is exactly 0 (ranks that share ``/proc/sys/kernel/random/boot_id`` share the clock).
Across machines each rank estimates its offset to device 0's clock by ping-pong (Cristian 1989):
offset = t_server − (t_send + t_receive) / 2 from the round trip with the smallest delay, good to
about half that delay. Collective over the group; run once, each wait bounded by ``timeout``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

__all__ = ["clock_offset"]


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        import socket

        return socket.gethostname()  # no such file (not Linux): fall back to the host name


def clock_offset(group: Any, timeout: float, recorder: Any, rounds: int = 5) -> float:
    """Seconds to add to this rank's ``time.perf_counter()`` to read device 0's clock (0 for no group)."""
    if group is None:
        return 0.0
    import torch
    import torch.distributed as dist

    from modelpar.pipeline.bounded_comm import all_gather_object, comm_device, is_nccl, wait

    ids = all_gather_object(_boot_id(), group, timeout, "the clock check (boot ids)", recorder)
    if len(set(ids)) == 1:
        return 0.0
    ranks, me, nccl = dist.get_process_group_ranks(group), dist.get_rank(group), is_nccl(group)
    buf = torch.zeros(1, dtype=torch.float64, device=comm_device(group))
    best = (float("inf"), 0.0)

    def exchange(op: Any, peer: int) -> None:
        wait(op(buf, ranks[peer], group=group), timeout, f"the clock ping-pong with rank {ranks[peer]}", recorder,
             nccl)

    for peer in range(1, len(ranks)):
        for _ in range(rounds):
            if me == 0:
                exchange(dist.irecv, peer)
                buf[0] = time.perf_counter()
                exchange(dist.isend, peer)
            elif me == peer:
                t0 = time.perf_counter()
                exchange(dist.isend, 0)
                exchange(dist.irecv, 0)
                t1 = time.perf_counter()
                best = min(best, (t1 - t0, buf.item() - (t0 + t1) / 2))
    return best[1]
