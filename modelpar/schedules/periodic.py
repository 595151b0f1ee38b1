"""A schedule that repeats one microbatch's building block every period (Qi et al. 2024b §3).

"Pipeline Parallelism with Controllable Memory" builds schedules from a building block — where
each action of one microbatch sits in time — repeated every Γ, the time one microbatch's work
takes on one rank (v chunks' F, I and W, each a chunk's share of the given whole-stage times).
The block is laid out in those times: microbatch 0's forwards down the stages, its I's back up,
then each W after its I (off the critical path), every action at the first time after its inputs
(and the block's offset ``gap``) where it overlaps nothing on its rank, the period repeating; where
nothing fits, the least overlapping place. Each rank then runs the repeated blocks in time order;
the simulator runs that order as early as it can, which squeezes the warm-up and the cool-down.
A compact block has the shortest lifespans: with the V placement, about K/3 microbatches'
activations per rank (V-Min); the offsets and the period's slack trade lifespan for speed.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

from modelpar._validate import check_int
from modelpar.schedules.action import Action, Kind
from modelpar.schedules.schedule import Schedule

__all__ = ["periodic"]


def periodic(stage_to_rank: Sequence[int], microbatches: int, name: str = "periodic", *,
             costs: Mapping[Kind, float] | None = None, slack: float = 0.0, gap: tuple[float, float] = (0.0, 0.0)) -> Schedule:
    """Repeat the compact building block of ``stage_to_rank`` for M microbatches (split backward).

    ``costs``: T_F, T_I, T_W of one whole stage (a chunk's action takes 1/v of it; default 1
    each): the block is laid out in those times, so its shape follows them (2024b §3: the block's
    shape is chosen from F, B and W). ``slack`` stretches the period the block repeats in by that
    fraction (room between its actions); ``gap`` (F, I) waits that long (whole-stage time units)
    between one stage's forward (input-gradient backward) and the next one's: the block's offsets."""
    dev = tuple(stage_to_rank)
    m = check_int("microbatches", microbatches, minimum=1)
    ranks = 1 + max(dev)
    counts = [dev.count(d) for d in range(ranks)]
    if len(set(counts)) != 1:
        raise ValueError(f"stage_to_rank must give every rank as many stages, got {dev}")
    v = counts[0]
    took = {k: (costs or {}).get(k, 1.0) / v for k in (Kind.F, Kind.I, Kind.W)}
    if not (all(x >= 0 for x in took.values()) and sum(took.values()) > 0):
        raise ValueError(f"costs must be >= 0 for F, I and W, not all 0, got {dict(costs or {})}")
    period = v * sum(took.values()) * (1 + slack)  # one microbatch's work on one rank, and the slack
    start = _block(dev, ranks, tuple(took.items()), period, (float(gap[0]), float(gap[1])))
    per_rank: list[list[tuple[float, Action]]] = [[] for _ in range(ranks)]
    for a, t0 in start:
        for j in range(m):
            per_rank[dev[a.stage]].append((t0 + j * period, Action(a.stage, a.kind, j)))
    return Schedule(dev, tuple(tuple(a for _, a in sorted(p)) for p in per_rank), name)


_EPS = 1e-9


@functools.lru_cache(maxsize=4096)
def _block(dev: tuple[int, ...], ranks: int, took_items: tuple[tuple[Kind, float], ...], period: float,
           gap: tuple[float, float]) -> tuple[tuple[Action, float], ...]:
    """Microbatch 0's actions and their start times in the block (independent of M, so kept: the V
    shapes' search lays out the same blocks for V-Min and V-Half and for every M)."""
    took = dict(took_items)
    used: list[list[tuple[float, float]]] = [[] for _ in range(ranks)]  # (start mod period, length)
    start: dict[Action, float] = {}

    def place(a: Action, ready: float) -> float:
        d, length = dev[a.stage], took[a.kind]
        starts = sorted(_starts(used[d], ready, period))  # the earliest start that fits; none fits: the earliest
        t = next((x for x in starts if _fits(used[d], x, length, period)), starts[0])
        used[d].append((t % period, length))
        start[a] = t
        return t + length

    t = 0.0
    for s in range(len(dev)):
        t = place(Action(s, Kind.F, 0), t + (gap[0] if s else 0.0))
    for s in reversed(range(len(dev))):
        after = t + (gap[1] if s < len(dev) - 1 else 0.0)
        t = place(Action(s, Kind.I, 0), max(after, start[Action(s, Kind.F, 0)] + took[Kind.F]))
    for s in reversed(range(len(dev))):
        place(Action(s, Kind.W, 0), start[Action(s, Kind.I, 0)] + took[Kind.I])
    return tuple(start.items())


def _starts(used: list[tuple[float, float]], ready: float, period: float) -> list[float]:
    """Where an action ready at ``ready`` may start: then, or where a used interval ends (within a period)."""
    base = ready - ready % period
    ends = [base + k * period + u + n for u, n in used for k in (-1, 0, 1, 2)]
    return [ready] + [e for e in ends if ready - _EPS <= e <= ready + 2 * period]


def _fits(used: list[tuple[float, float]], t: float, length: float, period: float) -> bool:
    """Whether [t, t + length) overlaps no used interval, the period repeating."""
    x = t % period
    for u, n in used:
        for k in (-1, 0, 1):
            if min(x + length, u + n + k * period) - max(x, u + k * period) > _EPS:
                return False
    return True
