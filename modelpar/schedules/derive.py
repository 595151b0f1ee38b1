"""Schedules derived from another one: its forward half (evaluation), or all of it on one rank.

``forward_only`` keeps each rank's forwards in their order: evaluation then runs through the
same runtime and the same lowered communication as training. ``on_one_rank`` puts every stage
on rank 0, actions in the order the simulator runs them (unit costs, ties by rank): the
schedule's work done by one process, e.g. to measure its memory without starting processes.
"""

from __future__ import annotations

from modelpar.schedules.action import Kind
from modelpar.schedules.replay import replay_times
from modelpar.schedules.schedule import Schedule

__all__ = ["forward_only", "on_one_rank"]


def forward_only(schedule: Schedule) -> Schedule:
    """``schedule`` without its backward actions: each rank runs its forwards in the same order.

    Dropping actions only removes waits, so a valid schedule gives a valid forward-only one.
    """
    f = Kind.F
    per_rank = tuple(tuple(a for a in acts if a.kind is f) for acts in schedule.validate().actions)
    return Schedule(schedule.stage_to_rank, per_rank, f"{schedule.name or 'schedule'} (forward only)")


def on_one_rank(schedule: Schedule) -> Schedule:
    """Every action of ``schedule`` on one rank, in simulated start order (ties: lower rank first)."""
    starts, _ = replay_times(schedule)
    order = sorted(
        (t, d, i) for d, times in enumerate(starts) for i, t in enumerate(times)
    )
    actions = (tuple(schedule.actions[d][i] for _, d, i in order),)
    return Schedule((0,) * schedule.num_stages, actions, f"{schedule.name or 'schedule'} (one rank)")


