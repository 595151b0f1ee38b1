"""Run a schedule as K blocking processes: each device does its actions in order, waiting for deps.

This one linear-time pass is both the deadlock check (``validate``) and the timing engine
(``modelpar.simulate``): an action starts at max(device free, each dependency's end + transfer
time when the dependency crosses devices). A device blocked on an unfinished action parks on it
and is woken when that action ends, so every action is looked at a bounded number of times.

Actions are identified by an integer key ``block(kind) * S * M + stage * M + microbatch`` so
that the bookkeeping is flat lists instead of dicts (half a million actions in well under 1 s).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from modelpar.schedules.action import Kind
from modelpar.schedules.schedule import Schedule

__all__ = ["execute"]

_F, _B, _I, _W = Kind.F, Kind.B, Kind.I, Kind.W


class _Invalid(Exception):
    """Internal: the fast pass found a problem; ``validate.diagnose`` explains it."""


def execute(
    schedule: Schedule,
    durations: Mapping[Kind, Sequence[float]] | None = None,
    transfer_in: Sequence[float] | None = None,
) -> tuple[list[list[float]], list[list[float]]]:
    """Return (starts, ends), one list per device aligned with ``schedule.actions``.

    ``durations[kind][stage]`` is the time of one action (default 1 for every action, so the
    start times are logical steps); ``transfer_in[s]`` is the time for a tensor to cross the
    boundary between stage s - 1 and stage s (default 0). Raises ValueError naming the first
    offending action when the schedule is incomplete, out of order or deadlocks.
    """
    try:
        return _run(schedule, durations, transfer_in)
    except _Invalid:
        from modelpar.schedules.validate import diagnose

        raise diagnose(schedule) from None


def _run(
    schedule: Schedule, durations: Mapping[Kind, Sequence[float]] | None, transfer_in: Sequence[float] | None
) -> tuple[list[list[float]], list[list[float]]]:
    S, M, D = schedule.num_stages, schedule.num_microbatches, schedule.num_devices
    split = schedule.split_backward
    dev = schedule.stage_to_device
    ones = [1.0] * S
    dur = {k: list((durations or {}).get(k, ones)) for k in (_F, _B, _I, _W)}
    xin = list(transfer_in) if transfer_in is not None else [0.0] * S
    grad = _I if split else _B
    SM = S * M
    off_g, off_w = SM, 2 * SM  # F block, then B-or-I block (a schedule has one), then W
    last = S - 1
    fin: list[float | None] = [None] * (3 * SM)
    waiting: list[list[int] | None] = [None] * (3 * SM)
    starts: list[list[float]] = [[] for _ in range(D)]
    ends: list[list[float]] = [[] for _ in range(D)]
    ptr = [0] * D
    clock = [0.0] * D
    ready = list(range(D - 1, -1, -1))
    done_devices = 0
    dur_f, dur_g, dur_w = dur[_F], dur[grad], dur[_W]
    while ready:
        d = ready.pop()
        acts = schedule.actions[d]
        n = len(acts)
        t = clock[d]
        st, en = starts[d].append, ends[d].append
        i = n
        for j in range(ptr[d], n):
            s, k, m = acts[j]  # an Action is a (stage, kind, microbatch) named tuple
            if not 0 <= s < S or m < 0 or dev[s] != d:
                raise _Invalid
            base = s * M + m
            r = t
            if k is _F:
                key = base
                if s:
                    f = fin[base - M]
                    if f is None:
                        i = j
                        _park(waiting, base - M, d)
                        break
                    f += xin[s]
                    if f > r:
                        r = f
                took = dur_f[s]
            elif k is grad:
                key = off_g + base
                f = fin[base]
                if f is None:
                    i = j
                    _park(waiting, base, d)
                    break
                if f > r:
                    r = f
                if s < last:
                    f = fin[key + M]
                    if f is None:
                        i = j
                        _park(waiting, key + M, d)
                        break
                    f += xin[s + 1]
                    if f > r:
                        r = f
                took = dur_g[s]
            elif k is _W:
                key = off_w + base
                f = fin[off_g + base]
                if f is None:
                    i = j
                    _park(waiting, off_g + base, d)
                    break
                if f > r:
                    r = f
                took = dur_w[s]
            else:  # B in a split schedule
                raise _Invalid
            if fin[key] is not None:  # duplicate
                raise _Invalid
            t = r + took
            fin[key] = t
            st(r)
            en(t)
            woken = waiting[key]
            if woken is not None:
                ready.extend(woken)
                waiting[key] = None
        ptr[d], clock[d] = i, t
        if i == n:
            done_devices += 1
    expected = SM * (1 if schedule.forward_only else 3 if split else 2)
    if done_devices != D or sum(len(acts) for acts in schedule.actions) != expected:
        raise _Invalid  # deadlock, or something missing
    return starts, ends


def _park(waiting: list[list[int] | None], key: int, device: int) -> None:
    w = waiting[key]
    if w is None:
        waiting[key] = [device]
    else:
        w.append(device)
