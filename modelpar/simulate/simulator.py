"""Time a schedule: every rank runs its list in order, each action as soon as its inputs arrive."""

from __future__ import annotations

from modelpar.schedules.replay import replay_times
from modelpar.schedules.schedule import Schedule
from modelpar.simulate.costs import Costs
from modelpar.simulate.timeline import Timeline

__all__ = ["simulate"]


def simulate(schedule: Schedule, costs: Costs | None = None) -> Timeline:
    """Return the timeline of ``schedule`` under ``costs`` (default: F = 1, B = 2, no transfer).

    Validates as it goes (the same linear pass): an incomplete, misordered or deadlocking
    schedule raises ValueError naming the first offending action. Linear in the number of actions.
    """
    costs = costs or Costs()
    starts, ends = replay_times(schedule, costs.durations(schedule), costs.transfer_in(schedule), costs.comm(schedule))
    return Timeline(schedule.actions, starts, ends, schedule)
