"""A list scheduler for split-backward schedules: each rank, whenever it is free, runs what is ready.

The zero-bubble papers' heuristic (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §3.2;
"Pipeline Parallelism with Controllable Memory", §4) in its plainest form. Time runs on the
given costs; a rank that comes free picks, among the actions whose inputs have arrived:

1. an input-gradient backward I (on the critical path), the oldest microbatch first;
2. a forward F, the oldest microbatch first — but a microbatch enters the rank's lowest stage
   (its first visit there) only while the rank holds at most ``limit`` − 1 microbatches'
   activations (a chunk counting 1/v, from F until its W: ``memory``'s rule): room for all of the
   new one's chunks;
3. a deferred weight-gradient backward W (oldest first), to fill what would be a bubble — and,
   since W is what frees a microbatch, the work a rank full of held microbatches turns to, so
   W's interleave with the steady state instead of piling up at the end.

With ``windows`` (one count per stage) a forward of stage s also waits while s holds
``windows[s]`` microbatches (F until W), and a W of such a stage goes before the others: per-stage
lag limits, as a repeated block has them; a rank's peak is then at most the sum of its stages'
windows (chunks). Nothing deadlocks: the oldest unfinished microbatch finds every stage empty of
older ones. With windows bounding the memory, ``forward_first`` may put ready F's before ready I's
(a V's second chunk starts its microbatch's way back sooner).

Forwards and backwards of a stage go in microbatch order. Later chunks of microbatches already
in never wait, so the peak can pass ``limit`` by a few chunks: callers that promise a memory
bound measure the result (``search``). Only first visits wait, so nothing deadlocks: the
microbatches a full rank holds have passed its first stage and never wait for memory again
before their backward, and a pending W is always ready (by induction from the last rank of the first chunk). Any placement
whose first chunk is stages 0..K−1 on ranks 0..K−1 works: contiguous, loop or V.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping, Sequence

from modelpar._validate import check_int
from modelpar.schedules.action import Action, Kind
from modelpar.schedules.memory import W_KEEPS
from modelpar.schedules.schedule import Schedule

__all__ = ["greedy"]

_F, _I, _W = Kind.F, Kind.I, Kind.W


def greedy(stage_to_rank: Sequence[int], microbatches: int, limit: float | Sequence[float], *,
           durations: Mapping[Kind, Sequence[float]] | None = None, transfer_in: Sequence[float] | None = None,
           windows: Sequence[int] | None = None, forward_first: bool = False, name: str = "greedy") -> Schedule:
    """The schedule the list scheduler above builds for ``stage_to_rank`` and M microbatches.

    ``durations[kind][stage]`` (F, I, W; default 1 each) and ``transfer_in[s]`` (default 0) are
    the costs it plans with, as in ``replay_times``; ``windows[s]`` (default none) the most
    microbatches stage s holds at once; ``forward_first``: ready F's before ready I's.
    """
    dev = tuple(stage_to_rank)
    S, M = len(dev), check_int("microbatches", microbatches, minimum=1)
    D = 1 + max(dev)
    caps = [float(x) for x in limit] if isinstance(limit, Sequence) else [float(limit)] * D
    if len(caps) != D or not all(x > 0 for x in caps):
        raise ValueError(f"limit must be > 0, one number or one per rank ({D}), got {limit!r}")
    win = [M] * S if windows is None else list(windows)
    if len(win) != S or not all(isinstance(x, int) and x >= 1 for x in win):
        raise ValueError(f"windows must be one int >= 1 per stage ({S}), got {windows!r}")
    ones = [1.0] * S
    took = {k: list((durations or {}).get(k, ones)) for k in (_F, _I, _W)}
    xin = list(transfer_in) if transfer_in is not None else [0.0] * S
    last = S - 1
    mine = [sorted((s for s in range(S) if dev[s] == d), reverse=True) for d in range(D)]  # highest first
    end_f: list[list[float | None]] = [[None] * M for _ in range(S)]
    end_i: list[list[float | None]] = [[None] * M for _ in range(S)]
    next_f, next_i = [0] * S, [0] * S
    pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(D)]
    lists: list[list[Action]] = [[] for _ in range(D)]
    left = [3 * M * len(mine[d]) for d in range(D)]
    clock = [0.0] * D
    asleep: dict[int, float] = {}  # rank -> the time it found nothing to do
    heap = [(0.0, d) for d in range(D) if left[d]]
    held = [0.0] * D  # activations held (F until W: ``memory``), a chunk counting 1/v
    in_stage = [0] * S  # microbatches each stage holds (F until W)
    w = D / S
    while heap:
        t, d = heapq.heappop(heap)
        if t != clock[d] or not left[d]:
            continue  # a stale entry
        asleep.pop(d, None)
        room = held[d] == 0 or held[d] + 1 <= caps[d] + 1e-9
        full = [s for s in mine[d] if in_stage[s] >= win[s]] if windows is not None else []
        choice, later = _pick(t, mine[d], M, last, room, full, end_f, end_i, next_f, next_i, pending_w[d], xin,
                              forward_first)
        if choice is None:
            asleep[d] = t
            clock[d] = later
            if later < float("inf"):
                heapq.heappush(heap, (later, d))
            continue
        kind, s, m, start = choice
        stop = start + took[kind][s]
        lists[d].append(Action(s, kind, m))
        left[d] -= 1
        if kind is _F:
            end_f[s][m] = stop
            next_f[s] += 1
            held[d] += w
            in_stage[s] += 1
        elif kind is _I:
            end_i[s][m] = stop
            next_i[s] += 1
            held[d] -= w * (1 - W_KEEPS)
            pending_w[d].append((s, m))
        else:
            held[d] -= w * W_KEEPS
            in_stage[s] -= 1
            pending_w[d].remove((s, m))
        clock[d] = stop
        if left[d]:
            heapq.heappush(heap, (stop, d))
        for e, since in asleep.items():  # what just ended may have made a sleeper's input ready
            wake = max(since, stop)
            if wake < clock[e]:
                clock[e] = wake
                heapq.heappush(heap, (wake, e))
    if any(left):
        stuck = next(d for d in range(D) if left[d])
        raise ValueError(f"stage_to_rank {dev} leaves rank {stuck} unable to finish: its first chunk "
                         f"must be stages 0..{D - 1} on ranks 0..{D - 1}")
    return Schedule(dev, tuple(map(tuple, lists)), name)


def _pick(t, stages, M, last, room, full, end_f, end_i, next_f, next_i, pending, xin, forward_first=False):
    """(kind, stage, microbatch, start) of what a rank runs at ``t``; else (None, when to look again).

    ``stages``: the rank's, highest first; ``room``: whether its lowest may take a new microbatch;
    ``full``: its stages at their window (no forward now; their W's first).
    Among ready I's (then F's) the oldest microbatch goes first, the higher stage on a tie."""

    def i_ready(s: int) -> float | None:  # its F done here, and the gradient from stage s + 1 arrived
        m = next_i[s]
        if m >= M or end_f[s][m] is None:
            return None
        if s == last:
            return end_f[s][m]
        g = end_i[s + 1][m]
        return None if g is None else max(end_f[s][m], g + xin[s + 1])

    def f_ready(s: int) -> float | None:  # the activation from stage s - 1 arrived (stage 0: always)
        m = next_f[s]
        if m >= M or (s == stages[-1] and not room) or s in full:
            return None
        if s == 0:
            return 0.0
        a = end_f[s - 1][m]
        return None if a is None else a + xin[s]

    later = float("inf")
    kinds = ((_I, i_ready, next_i), (_F, f_ready, next_f))  # I first, then F
    for kind, ready_at, following in (kinds[::-1] if forward_first else kinds):
        best = None
        for s in stages:
            ready = ready_at(s)
            if ready is None:
                continue
            if ready > t:
                later = min(later, ready)
            elif best is None or following[s] < best[2]:
                best = (kind, s, following[s], t)
        if best is not None:
            return best, later
    if pending:
        s, m = next((x for x in pending if x[0] in full), pending[0])
        return (_W, s, m, t), later
    return None, later
