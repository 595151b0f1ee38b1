"""Replay a schedule as K blocking processes: each rank does its actions in order, waiting for deps.

This one linear-time pass is the deadlock check (``validate``), the timing engine
(``modelpar.simulate``) and the order lowering appends actions in (``lower``): an action starts
at max(rank free, each dependency's end + transfer time when the dependency crosses ranks).
A rank blocked on an unfinished action parks on it and is woken when that action ends, so
every action is looked at a bounded number of times. An overlapped F&B pair (``Schedule.overlapped``)
is timed by ``overlap.pair_span`` (``comm``: the part of each action that is communication).

What an action waits for comes from ``kinds.SPECS``, resolved once per (kind, stage) into the
integer keys of its producers: an action's key is ``block(kind) * S * M + stage * M +
microbatch``, so the bookkeeping is flat lists instead of dicts (half a million actions in
well under 1 s).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from modelpar.schedules.action import Action, Kind
from modelpar.schedules.diagnosis import diagnose
from modelpar.schedules.kinds import inputs_of, producers
from modelpar.schedules.overlap import pair_span

if TYPE_CHECKING:  # for annotations only: schedule.py imports validation, which imports this
    from modelpar.schedules.schedule import Schedule

__all__ = ["Replay", "replay_times", "replay_traced"]


class _Invalid(Exception):
    """Internal: the fast pass found a problem; ``diagnosis.diagnose`` explains it."""


class Replay(NamedTuple):
    """What the blocking replay did: times per rank, the order actions ran in, where ranks stopped."""

    starts: list[list[float]]
    ends: list[list[float]]
    order: list[Action]  # one valid interleaving (only when asked for)
    stuck: dict[int, tuple[int, Action]]  # rank -> (position it stopped at, the dependency it waits for)


def replay_times(
    schedule: Schedule,
    durations: Mapping[Kind, Sequence[float]] | None = None,
    transfer_in: Sequence[float] | None = None,
    comm: Mapping[Kind, Sequence[float]] | None = None,
) -> tuple[list[list[float]], list[list[float]]]:
    """Return (starts, ends), one list per rank aligned with ``schedule.actions``.

    ``durations[kind][stage]`` is the time of one action (default 1 for every action, so the
    start times are logical steps); ``transfer_in[s]`` is the time for a tensor to cross the
    boundary between stage s - 1 and stage s (default 0); ``comm[kind][stage]`` the part of an
    action's duration that is communication an overlapped pair hides (default 0). Raises
    ValueError naming the first offending action when the schedule is incomplete, out of order or deadlocks.
    """
    try:
        run = _replay(schedule, durations, transfer_in, trace=False, comm=comm)
    except _Invalid:  # an action out of place, of another style or repeated: diagnose names it before any deadlock
        raise diagnose(schedule, {}) from None
    if run.stuck or not _complete(schedule):
        raise diagnose(schedule, run.stuck)
    return run.starts, run.ends


def replay_traced(schedule: Schedule) -> Replay:
    """The blocking replay with unit times, recording the order and where ranks stop.

    For a schedule whose actions are each on their stage's rank, of one style, and not
    repeated (``validate`` checks those first); a deadlock shows in ``stuck``.
    """
    return _replay(schedule, None, None, trace=True)


def _complete(schedule: Schedule) -> bool:
    expected = schedule.num_stages * schedule.num_microbatches * len(schedule.style)
    return sum(len(acts) for acts in schedule.actions) == expected


def _replay(schedule: Schedule, durations: Mapping[Kind, Sequence[float]] | None,
            transfer_in: Sequence[float] | None, trace: bool,
            comm: Mapping[Kind, Sequence[float]] | None = None) -> Replay:
    S, M, D = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks
    dev = schedule.stage_to_rank
    style = schedule.style
    block = {k: i for i, k in enumerate(style)}
    made = producers(style)
    ones = [1.0] * S
    xin = list(transfer_in) if transfer_in is not None else [0.0] * S
    zeros = [0.0] * S
    inside = {k: list((comm or {}).get(k, zeros)) for k in style}
    pairs = [set(p) for p in schedule.overlapped]
    # per kind, per stage: (own key offset, duration, ((producer key offset, transfer time), ...))
    spec: dict[Kind, list[tuple[int, float, tuple[tuple[int, float], ...]]]] = {}
    for k in style:
        times = list((durations or {}).get(k, ones))
        rows = []
        for s in range(S):
            ins = tuple(
                (block[made[v]] * S * M + p * M, xin[max(p, s)] if p != s else 0.0)
                for v, p in inputs_of(k, s) if 0 <= p < S
            )
            rows.append((block[k] * S * M + s * M, times[s], ins))
        spec[k] = rows
    fin: list[float | None] = [None] * (len(style) * S * M)
    waiting: list[list[int] | None] = [None] * len(fin)
    starts: list[list[float]] = [[] for _ in range(D)]
    ends: list[list[float]] = [[] for _ in range(D)]
    order: list[Action] = []
    ptr = [0] * D
    clock = [0.0] * D
    blocked_on: dict[int, int] = {}
    ready = list(range(D - 1, -1, -1))
    while ready:
        d = ready.pop()
        acts = schedule.actions[d]
        n = len(acts)
        t = clock[d]
        st, en = starts[d].append, ends[d].append
        paired = pairs[d]
        i = n
        j = ptr[d]
        while j < n:
            a = acts[j]
            s, k, m = a  # an Action is a (stage, kind, microbatch) named tuple
            if not 0 <= s < S or m < 0 or dev[s] != d or k not in spec:
                raise _Invalid
            own, took, ins = spec[k][s]
            r = t
            need = -1
            for off, x in ins:
                f = fin[off + m]
                if f is None:
                    need = off + m
                    break
                f += x
                if f > r:
                    r = f
            group = None
            if need < 0 and paired and j in paired:  # an overlapped pair: its backward's inputs too
                b = acts[j + 1]
                s2, k2, m2 = b
                if not 0 <= s2 < S or m2 < 0 or dev[s2] != d or k2 not in spec:
                    raise _Invalid
                r2 = t
                for off, x in spec[k2][s2][2]:
                    f = fin[off + m2]
                    if f is None:
                        need = off + m2
                        break
                    f += x
                    if f > r2:
                        r2 = f
                group = ((a, b), pair_span(r, took, inside[k][s], r2, spec[k2][s2][1], inside[k2][s2]))
            if need >= 0:
                i = j
                w = waiting[need]
                if w is None:
                    waiting[need] = [d]
                else:
                    w.append(d)
                blocked_on[d] = need
                break
            if group is None:  # one action (the fast path)
                key = own + m
                if fin[key] is not None:  # duplicate
                    raise _Invalid
                t = r + took
                fin[key] = t
                st(r)
                en(t)
                if trace:
                    order.append(a)
                woken = waiting[key]
                if woken is not None:
                    ready.extend(woken)
                    waiting[key] = None
                j += 1
                continue
            for a, (r, t) in zip(*group):
                s, k, m = a
                key = spec[k][s][0] + m
                if fin[key] is not None:  # duplicate
                    raise _Invalid
                fin[key] = t
                st(r)
                en(t)
                if trace:
                    order.append(a)
                woken = waiting[key]
                if woken is not None:
                    ready.extend(woken)
                    waiting[key] = None
            j += 2
        ptr[d], clock[d] = i, t
    stuck = {d: (ptr[d], _action(blocked_on[d], style, S, M)) for d in range(D) if ptr[d] < len(schedule.actions[d])}
    return Replay(starts, ends, order, stuck)


def _action(key: int, style: tuple[Kind, ...], stages: int, microbatches: int) -> Action:
    """The action with integer key ``key`` (the inverse of ``block * S * M + stage * M + microbatch``)."""
    b, rest = divmod(key, stages * microbatches)
    s, m = divmod(rest, microbatches)
    return Action(s, style[b], m)
