"""Latency and bandwidth of all-reduce, all-gather, reduce-scatter and point-to-point per group size.

For a group of the first g ranks each collective is timed at a few message sizes; the profile keeps
the points (interpolated between) and their least-squares ``time = latency + bytes/bandwidth`` line
(used beyond the largest), ``bytes`` being what one rank sends with a
ring algorithm (``modelpar.formulas``: 2(g − 1)/g·S for an all-reduce of S bytes, (g − 1)/g·S for
an all-gather or reduce-scatter whose whole tensor is S; the message for point-to-point, timed as
half a ping-pong). Every rank takes part in every measurement (group creation is collective).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from modelpar._compat import all_gather_single, reduce_scatter_single
from modelpar.calibrate.compute import timed
from modelpar.formulas import allgather_bytes, allreduce_bytes

__all__ = ["SIZES", "fit_line", "measure_collectives", "measured_cost", "non_decreasing", "sizes"]

# bytes of the whole tensor (fp32): from a latency-bound message to past what a step sends at once (a CPU-sized
# model's gradient bucket is a few MB; a GPU's is tens). A fit through sizes all below a step's bucket
# extrapolates its bandwidth from points the latency dominates: from 4 KB - 1 MB on a 2-core VM, three
# calibrations minutes apart gave a pair's all-reduce 0.48-1.6 GB/s.
SIZES = {"cpu": (1 << 12, 1 << 16, 1 << 20, 1 << 22), "cuda": (1 << 16, 1 << 20, 1 << 24, 1 << 26)}


def sizes(device: torch.device) -> tuple[int, ...]:
    """The message sizes measured on ``device``'s kind."""
    return SIZES.get(device.type, SIZES["cpu"])


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(latency s, GB/s) of the least-squares line time = latency + bytes/bandwidth through (bytes, s) points.

    A negative intercept is clamped to 0 and a non-positive slope (noise) gives the largest bytes/s seen.
    """
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    if slope <= 0:
        return max(0.0, min(y for _, y in points)), max(x / y for x, y in points) / 1e9
    return max(0.0, my - slope * mx), 1.0 / slope / 1e9


def non_decreasing(values: list[float]) -> list[float]:
    """The least-squares non-decreasing sequence closest to ``values`` (pool adjacent violators): a collective of
    more bytes does not cost less, and a noisy point must not make it seem to."""
    blocks: list[list[float]] = []  # [sum, count] of pooled runs
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def measured_cost(points: list[tuple[float, float]]) -> list[Any]:
    """A profile's entry for (bytes sent, seconds) points: ``[latency_s, GB/s, [[bytes, s], ...]]``, the line fit
    (``fit_line``, used beyond the largest size) and the points, ascending and made ``non_decreasing``, which
    ``costmodel.profiles.CollectiveCost`` interpolates between."""
    points = sorted(points)
    latency, gbps = fit_line(points)
    return [latency, gbps, [[x, y] for (x, _), y in zip(points, non_decreasing([y for _, y in points]))]]


def _time_op(op: str, group: object, g: int, nbytes: int, device: torch.device, reps: int) -> tuple[float, float]:
    """(bytes one rank sends, seconds) of one ``op`` on a ``nbytes`` tensor over ``group`` of g ranks."""
    n = nbytes // 4 // g * g  # whole shards
    nbytes = 4 * n
    full = torch.ones(n, device=device)
    if op == "all_reduce":
        return allreduce_bytes(nbytes, g), timed(lambda: dist.all_reduce(full, group=group), device, reps=reps)
    if op == "all_gather":
        shard = torch.ones(n // g, device=device)
        return allgather_bytes(nbytes, g), timed(lambda: all_gather_single(full, shard, group=group), device, reps=reps)
    shard = torch.ones(n // g, device=device)
    return allgather_bytes(nbytes, g), timed(lambda: reduce_scatter_single(shard, full, group=group), device, reps=reps)


def _ping_pong(nbytes: int, device: torch.device, reps: int) -> float:
    """Seconds of one message of ``nbytes`` from rank 0 to rank 1 (half a round trip); other ranks idle."""
    buf = torch.ones(nbytes // 4, device=device)
    rank = dist.get_rank()

    def round_trip() -> None:
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    return timed(round_trip, device, reps=reps) / 2


def measure_collectives(device: torch.device, local_size: int, reps: int = 5) -> dict[str, dict[str, dict[str, list[Any]]]]:
    """op -> link -> str(group size) -> ``measured_cost`` for groups of the first 2 … world ranks.

    A group of more than ``local_size`` ranks (the processes on one node) crosses nodes: link "inter".
    Rank 0's timings are returned (every rank returns the same structure).
    """
    world = dist.get_world_size()
    out: dict[str, dict[str, dict[str, list[Any]]]] = {}
    for g in range(2, world + 1):
        group = dist.new_group(list(range(g)))
        link = "intra" if g <= local_size else "inter"
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            if dist.get_rank() < g:
                points = [_time_op(op, group, g, size, device, reps=reps) for size in sizes(device)]
            else:  # outside the group: nothing to time, but keep in step with the group's barriers
                points = [(1.0, 1.0)]
                for _ in sizes(device):
                    timed(lambda: None, device, reps=reps)
            out.setdefault(op, {}).setdefault(link, {})[str(g)] = measured_cost(points)
    p2p = measured_cost([(float(size), _ping_pong(size, device, reps=reps)) for size in sizes(device)])
    out["p2p"] = {"intra" if local_size >= 2 else "inter": {"2": p2p}}
    return out
