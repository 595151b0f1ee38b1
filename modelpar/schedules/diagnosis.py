"""Why a schedule cannot run: the first offending action, named (pure Python).

The linear-time blocking replay (``replay``) finds that a schedule fails; only then does
``diagnose`` walk it again, slowly and clearly, to name the first offending action: wrong rank,
mixed B with I/W, duplicate, missing, out of order, deadlock. The deadlock's chain is read from
where the replay left each rank (``stuck``), so nothing here runs the replay: this module sits
below it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from modelpar.schedules.action import Action
from modelpar.schedules.kinds import SPECS

if TYPE_CHECKING:  # for annotations only: schedule.py imports validation, which imports this
    from modelpar.schedules.schedule import Schedule

__all__ = ["DeadlockError", "Stuck", "deadlock_chain", "diagnose"]

Stuck = Mapping[int, tuple[int, Action]]  # rank -> (position it stopped at, the dependency it waits for)


class DeadlockError(ValueError):
    """The schedule is complete and ordered on each rank, but its ranks wait on each other."""


def diagnose(schedule: Schedule, stuck: Stuck) -> ValueError:
    """Return the ValueError that explains why ``schedule`` cannot run (checks in a fixed order); ``stuck`` is
    where the replay left each rank that did not finish."""
    label = f" {schedule.name!r}" if schedule.name else ""
    for check in (_placement, _kinds, _duplicates, _missing, _local_order):
        message = check(schedule)
        if message:
            return ValueError(f"invalid schedule{label}: {message}")
    message = _deadlock(schedule, stuck)
    if message:
        return DeadlockError(f"invalid schedule{label}: {message}")
    return ValueError("invalid schedule: it cannot run to the end")  # not reached: checks are exhaustive


def _where(schedule: Schedule) -> dict[Action, tuple[int, int]]:
    return {a: (d, p) for d, acts in enumerate(schedule.actions) for p, a in enumerate(acts)}


def _placement(schedule: Schedule) -> str:
    for d, acts in enumerate(schedule.actions):
        for p, a in enumerate(acts):
            if not 0 <= a.stage < schedule.num_stages or a.microbatch < 0:
                return (
                    f"action {a} (rank {d}, position {p}) is out of range: stages are "
                    f"0..{schedule.num_stages - 1}, microbatches >= 0"
                )
            if schedule.rank_of(a.stage) != d:
                return (
                    f"action {a} is in rank {d}'s list (position {p}), but stage {a.stage} "
                    f"lives on rank {schedule.rank_of(a.stage)}"
                )
    return ""


def _kinds(schedule: Schedule) -> str:
    """Every action of the schedule's style (``kinds.STYLES``): a split backward is split everywhere."""
    style = schedule.style
    others = style[1:]  # what the schedule uses beyond the forward
    example = next((a for acts in schedule.actions for a in acts if a.kind in others), None)
    for d, acts in enumerate(schedule.actions):
        for p, a in enumerate(acts):
            if a.kind not in style:
                names = " and ".join(k.value for k in others)
                return (
                    f"action {a} (rank {d}, position {p}) is {SPECS[a.kind].describe}, but the schedule "
                    f"splits the backward into {names} (e.g. {example}); use {names} everywhere"
                )
    return ""


def _duplicates(schedule: Schedule) -> str:
    seen: dict[Action, tuple[int, int]] = {}
    for d, acts in enumerate(schedule.actions):
        for p, a in enumerate(acts):
            if a in seen:
                d0, p0 = seen[a]
                return (
                    f"action {a} appears twice (rank {d0} position {p0}, rank {d} position "
                    f"{p}); each (stage, microbatch) gets each kind exactly once"
                )
            seen[a] = (d, p)
    return ""


def _missing(schedule: Schedule) -> str:
    present = set(_where(schedule))
    kinds = schedule.style
    names = ", ".join(k.value for k in kinds)
    for s in range(schedule.num_stages):
        for m in range(schedule.num_microbatches):
            for k in kinds:
                a = Action(s, k, m)
                if a not in present:
                    return (
                        f"action {a} is missing (rank {schedule.rank_of(s)}): every stage "
                        f"0..{schedule.num_stages - 1} needs {names} for every microbatch "
                        f"0..{schedule.num_microbatches - 1}"
                    )
    return ""


def _local_order(schedule: Schedule) -> str:
    where = _where(schedule)
    for d, acts in enumerate(schedule.actions):
        for p, a in enumerate(acts):
            for dep in schedule.dependencies(a):
                dd, dp = where[dep]
                if dd == d and dp > p:
                    return (
                        f"rank {d} runs {a} (position {p}) before its dependency {dep} "
                        f"(position {dp})"
                    )
    return ""


def deadlock_chain(schedule: Schedule, stuck: Stuck) -> list[tuple[int, int, Action, Action, int]]:
    """The ranks of a deadlocking schedule that wait on each other, from the lowest ``stuck`` one (the replay's).

    Each link: (rank, the position it stopped at, the action there, the dependency it waits
    for, the rank that owes it); the chain follows owners until it closes. Empty if none is stuck.
    """
    chain: list[tuple[int, int, Action, Action, int]] = []
    d, seen = min(stuck, default=-1), set()
    while d in stuck and d not in seen:
        seen.add(d)
        position, need = stuck[d]
        owner = schedule.rank_of(need.stage)
        chain.append((d, position, schedule.actions[d][position], need, owner))
        d = owner
    return chain


def _deadlock(schedule: Schedule, stuck: Stuck) -> str:
    chain = deadlock_chain(schedule, stuck)
    if not chain:
        return ""
    return "deadlock: " + "; ".join(f"rank {d} waits at {a} (position {p}) for {need} on rank {owner}"
                                    for d, p, a, need, owner in chain) + " (a cycle: no rank can move)"
