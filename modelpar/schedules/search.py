"""Pick, among candidate schedules, the fastest whose held activations fit a per-rank limit.

``timer`` gives a schedule's step time (default: every action one unit, no transfers — the
generators' view; the simulator passes real costs). The peak is the simulator's (``memory``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from modelpar.schedules.memory import peak_held
from modelpar.schedules.replay import replay_times
from modelpar.schedules.schedule import Schedule

__all__ = ["fastest_within", "peak", "unit_step"]

Timer = Callable[[Schedule], float]


def unit_step(schedule: Schedule) -> float:
    """Step time with every action one unit long and free transfers."""
    _, ends = replay_times(schedule)
    return max((max(e) for e in ends if e), default=0.0)


def peak(schedule: Schedule) -> float:
    """The largest per-rank peak of held activations (whole-stage microbatches)."""
    return max(peak_held(schedule.actions, schedule.chunks))


def fastest_within(candidates: Iterable[Schedule], limit: float, timer: Timer | None = None,
                   ) -> tuple[Schedule, float] | None:
    """(the fastest candidate with peak ≤ ``limit``, its step time); None if none fits.

    Ties go to the earlier candidate."""
    timer = timer or unit_step
    best: tuple[Schedule, float] | None = None
    for s in candidates:
        if peak(s) <= limit + 1e-9:
            t = timer(s)
            if best is None or t < best[1] - 1e-12:
                best = (s, t)
    return best
