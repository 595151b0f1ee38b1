"""Turn a real run into the simulator's objects: a measured ``Timeline``, and a prediction from it.

The runtime records every action's start and end on every rank; ``gather_timeline`` collects
them into the same ``Timeline`` the simulator produces, so the ASCII / PNG / trace renderers draw
the real run. ``measured_durations`` averages the run's cost of each (kind, stage), and
``predict`` feeds those costs (plus a measured transfer time) back to the simulator: the step
time and bubble the schedule *should* have had with these compute costs, to set beside the
measured ones.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from modelpar.schedules.action import Action, Kind
from modelpar.schedules.execute import execute
from modelpar.schedules.schedule import Schedule
from modelpar.simulate.costs import Costs
from modelpar.simulate.timeline import Event, Timeline

__all__ = ["gather_timeline", "measured_durations", "predict"]


def gather_timeline(events: Sequence[tuple[Action, float, float]], schedule: Schedule, group: Any) -> Timeline:
    """Collective over ``group``: every device's (action, start, end) of one step, as a Timeline."""
    import torch.distributed as dist

    mine = [(str(a), float(s), float(e)) for a, s, e in events]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return Timeline(
        [Event(d, Action.parse(a), s, e) for d, rows in enumerate(everyone) for a, s, e in rows],
        schedule.num_devices,
        schedule,
        unit="s",
    )


def measured_durations(timelines: Iterable[Timeline]) -> dict[Kind, list[float]]:
    """Mean duration of each kind on each virtual stage over all ``timelines`` (seconds).

    The mean, not the median: it keeps each device's total work, so a prediction from it has
    the busy time the run had (on a loaded machine a few preempted actions carry much of it).
    """
    timelines = list(timelines)
    if not timelines:
        raise ValueError("timelines must hold at least one measured timeline, got none")
    stages = len(timelines[0].stage_to_device)
    samples: dict[Kind, list[list[float]]] = {k: [[] for _ in range(stages)] for k in Kind}
    for tl in timelines:
        for e in tl.events:
            samples[e.action.kind][e.action.stage].append(e.end - e.start)
    return {k: [statistics.fmean(x) if x else 0.0 for x in per_stage] for k, per_stage in samples.items()}


def predict(schedule: Schedule, durations: dict[Kind, list[float]], transfer: float = 0.0) -> Timeline:
    """Simulate ``schedule`` with measured per-(kind, stage) ``durations`` and a cross-device ``transfer``."""
    starts, ends = execute(schedule, durations, Costs(transfer=transfer).transfer_in(schedule))
    return Timeline.from_columns(schedule, starts, ends, unit="s")
