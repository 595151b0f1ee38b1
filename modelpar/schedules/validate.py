"""Schedule validation: complete, ordered on each device, and free of deadlock.

``validate_schedule`` runs the linear-time blocking execution of ``execute``; only when that
fails does ``diagnose`` walk the schedule again, slowly and clearly, to name the first
offending action: wrong device, mixed B with I/W, duplicate, missing, out of order, deadlock.
"""

from __future__ import annotations

from modelpar.schedules.action import Action, Kind
from modelpar.schedules.schedule import Schedule

__all__ = ["DeadlockError", "diagnose", "validate_schedule"]


class DeadlockError(ValueError):
    """The schedule is complete and ordered on each device, but its devices wait on each other."""


def validate_schedule(schedule: Schedule) -> None:
    """Raise ValueError naming the first offending action unless ``schedule`` can run to the end."""
    from modelpar.schedules.execute import execute

    execute(schedule)


def diagnose(schedule: Schedule) -> ValueError:
    """Return the ValueError that explains why ``schedule`` cannot run (checks in a fixed order)."""
    for check in (_placement, _kinds, _duplicates, _missing, _local_order, _deadlock):
        message = check(schedule)
        if message:
            label = f" {schedule.name!r}" if schedule.name else ""
            error = DeadlockError if check is _deadlock else ValueError
            return error(f"invalid schedule{label}: {message}")
    return ValueError("invalid schedule: it cannot run to the end")  # not reached: checks are exhaustive


def _where(schedule: Schedule) -> dict[Action, tuple[int, int]]:
    return {a: (d, p) for d, acts in enumerate(schedule.actions) for p, a in enumerate(acts)}


def _placement(schedule: Schedule) -> str:
    for d, acts in enumerate(schedule.actions):
        for p, a in enumerate(acts):
            if not 0 <= a.stage < schedule.num_stages or a.microbatch < 0:
                return (
                    f"action {a} (device {d}, position {p}) is out of range: stages are "
                    f"0..{schedule.num_stages - 1}, microbatches >= 0"
                )
            if schedule.device_of(a.stage) != d:
                return (
                    f"action {a} is in device {d}'s list (position {p}), but stage {a.stage} "
                    f"lives on device {schedule.device_of(a.stage)}"
                )
    return ""


def _kinds(schedule: Schedule) -> str:
    if not schedule.split_backward:
        return ""
    example = next(a for acts in schedule.actions for a in acts if a.kind in (Kind.I, Kind.W))
    for d, acts in enumerate(schedule.actions):
        for p, a in enumerate(acts):
            if a.kind is Kind.B:
                return (
                    f"action {a} (device {d}, position {p}) is a full backward B, but the schedule "
                    f"splits the backward into I and W (e.g. {example}); use I and W everywhere"
                )
    return ""


def _duplicates(schedule: Schedule) -> str:
    seen: dict[Action, tuple[int, int]] = {}
    for d, acts in enumerate(schedule.actions):
        for p, a in enumerate(acts):
            if a in seen:
                d0, p0 = seen[a]
                return (
                    f"action {a} appears twice (device {d0} position {p0}, device {d} position "
                    f"{p}); each (stage, microbatch) gets each kind exactly once"
                )
            seen[a] = (d, p)
    return ""


def _missing(schedule: Schedule) -> str:
    present = set(_where(schedule))
    kinds = ((Kind.F,) if schedule.forward_only else (Kind.F, Kind.I, Kind.W) if schedule.split_backward
             else (Kind.F, Kind.B))
    names = ", ".join(k.value for k in kinds)
    for s in range(schedule.num_stages):
        for m in range(schedule.num_microbatches):
            for k in kinds:
                a = Action(s, k, m)
                if a not in present:
                    return (
                        f"action {a} is missing (device {schedule.device_of(s)}): every stage "
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
                        f"device {d} runs {a} (position {p}) before its dependency {dep} "
                        f"(position {dp})"
                    )
    return ""


def blocking_run(schedule: Schedule) -> tuple[list[Action], dict[int, tuple[int, Action]]]:
    """Run the devices as blocking processes (linear: a blocked device parks on what it needs).

    Returns the actions in the order they ran (one valid interleaving), and for each device that
    could not finish, (the position it stopped at, the dependency it waits for).
    """
    done: set[Action] = set()
    order: list[Action] = []
    ptr = [0] * schedule.num_devices
    parked: dict[Action, list[int]] = {}
    blocked_on: dict[int, Action] = {}
    ready = list(range(schedule.num_devices - 1, -1, -1))
    while ready:
        d = ready.pop()
        acts = schedule.actions[d]
        while ptr[d] < len(acts):
            a = acts[ptr[d]]
            need = next((dep for dep in schedule.dependencies(a) if dep not in done), None)
            if need is not None:
                parked.setdefault(need, []).append(d)
                blocked_on[d] = need
                break
            blocked_on.pop(d, None)
            done.add(a)
            order.append(a)
            ready.extend(parked.pop(a, ()))
            ptr[d] += 1
    stuck = {d: (ptr[d], blocked_on[d]) for d in range(schedule.num_devices) if ptr[d] < len(schedule.actions[d])}
    return order, stuck


def _deadlock(schedule: Schedule) -> str:
    _, stuck = blocking_run(schedule)
    if not stuck:
        return ""
    chain, d, seen = [], min(stuck), set()
    while d not in seen:
        seen.add(d)
        position, need = stuck[d]
        owner = schedule.device_of(need.stage)
        chain.append(f"device {d} waits at {schedule.actions[d][position]} (position {position}) for {need} "
                     f"on device {owner}")
        d = owner
    return "deadlock: " + "; ".join(chain) + " (a cycle: no device can move)"
