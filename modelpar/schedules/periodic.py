"""A schedule that repeats one microbatch's building block every period (Qi et al. 2024b §3).

"Pipeline Parallelism with Controllable Memory" builds schedules from a building block — where
each action of one microbatch sits in time — repeated every Γ, the time one microbatch's work
takes on one rank. Here all actions last one slot (F, I and W of a chunk; Γ = 3v slots) and
the block is as compact as the repetition allows: microbatch 0's forwards down the stages, its
I's back up, then each W after its I (off the critical path), every action in the first slot after its inputs whose
place in the period is still free on its rank. Each rank then runs the repeated blocks in
time order; the simulator runs that order as early as it can, which squeezes the warm-up and
the cool-down. A compact block has the shortest lifespans: with the V placement, about K/3
microbatches' activations per rank (V-Min).
"""

from __future__ import annotations

from collections.abc import Sequence

from modelpar._validate import check_int
from modelpar.schedules.action import Action, Kind
from modelpar.schedules.schedule import Schedule

__all__ = ["periodic"]


def periodic(stage_to_rank: Sequence[int], microbatches: int, name: str = "periodic") -> Schedule:
    """Repeat the compact building block of ``stage_to_rank`` for M microbatches (split backward)."""
    dev = tuple(stage_to_rank)
    m = check_int("microbatches", microbatches, minimum=1)
    ranks = 1 + max(dev)
    counts = [dev.count(d) for d in range(ranks)]
    if len(set(counts)) != 1:
        raise ValueError(f"stage_to_rank must give every rank as many stages, got {dev}")
    period = 3 * counts[0]
    used: list[set[int]] = [set() for _ in range(ranks)]
    start: dict[Action, int] = {}

    def place(a: Action, ready: int) -> int:
        d, t = dev[a.stage], ready
        while t % period in used[d]:
            t += 1
        used[d].add(t % period)
        start[a] = t
        return t + 1

    t = 0
    for s in range(len(dev)):
        t = place(Action(s, Kind.F, 0), t)
    for s in reversed(range(len(dev))):
        t = place(Action(s, Kind.I, 0), max(t, start[Action(s, Kind.F, 0)] + 1))
    for s in reversed(range(len(dev))):
        place(Action(s, Kind.W, 0), start[Action(s, Kind.I, 0)] + 1)
    per_rank: list[list[tuple[int, Action]]] = [[] for _ in range(ranks)]
    for a, t0 in start.items():
        for j in range(m):
            per_rank[dev[a.stage]].append((t0 + j * period, Action(a.stage, a.kind, j)))
    return Schedule(dev, tuple(tuple(a for _, a in sorted(p)) for p in per_rank), name)
