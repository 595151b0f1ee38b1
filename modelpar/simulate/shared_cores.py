"""Time a schedule whose processes outnumber the CPU's cores: the cores are shared by whoever computes.

``schedules.replay_times`` gives each action its priced duration whatever the other ranks do. The local cost
model prices a CPU run with more processes than cores as if every process computed all the time (each action
``local_compute.core_share`` times slower than on a core of its own). A pipeline's ranks do not: in its fill and
drain, and while a stage waits for its neighbour, the stages that do compute get the idle ranks' cores. The
default ``modelpar train`` (4 ranks on 2 cores, p = 2) was predicted 37-77% too slow that way.

``replay_shared`` keeps each priced duration as the action's *work* and runs it at the speed the moment allows
(processor sharing, as the operating system's scheduler time-slices runnable processes):

    speed(k) = max(1, world / cores) / max(1, k / cores)

with k the processes computing, ``group`` per pipeline rank that computes (the t·cp·d processes of a pipeline rank
run the same actions at once), so with every rank busy an action takes its priced time, and with half of them
idle on a machine they saturated, half of it. An action starts when its rank is free and its inputs have arrived
(a transfer takes its priced time whatever the load). Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from modelpar.schedules.action import Kind
from modelpar.schedules.kinds import inputs_of, producers

if TYPE_CHECKING:
    from modelpar.schedules.schedule import Schedule

__all__ = ["replay_shared", "speed"]

_DONE = 1e-12  # work left (s) below which an action has ended: the float residue of its last slice


def speed(computing: int, world: int, cores: int) -> float:
    """How much faster than priced an action runs while ``computing`` of the ``world`` processes compute on
    ``cores`` cores (priced: all of them computing)."""
    return max(1.0, world / cores) / max(1.0, computing / cores)


def replay_shared(schedule: Schedule, durations: Mapping[Kind, Sequence[float]], transfer_in: Sequence[float],
                  group: int, cores: int) -> tuple[list[list[float]], list[list[float]]]:
    """(starts, ends) of ``schedule``'s actions, one list per rank like ``replay_times``, with each pipeline rank
    standing for ``group`` processes and ``cores`` cores shared by those computing (``speed``).

    ``durations[kind][stage]``: an action's seconds with every process computing; ``transfer_in[s]``: a tensor's
    time from stage s − 1 to s. An overlapped F&B pair (DualPipe) runs its halves back to back, as a CPU does (its
    ranks have no communication beside compute to hide: ``replay_times`` with no ``comm``). For a schedule
    ``validate`` accepts; ValueError if it cannot finish.
    """
    D, S = schedule.num_ranks, schedule.num_stages
    world = D * group
    made = producers(schedule.style)
    ended: dict[tuple[Kind, int, int], float] = {}
    starts: list[list[float]] = [[] for _ in range(D)]
    ends: list[list[float]] = [[] for _ in range(D)]
    position = [0] * D
    busy = [False] * D  # the rank computes an action
    left = [0.0] * D  # work left of that action (seconds at the priced speed)
    free = [0.0] * D  # when each rank ended its last action
    now = 0.0
    while True:
        arrivals = []
        for d in range(D):
            if busy[d] or position[d] == len(schedule.actions[d]):
                continue
            stage, kind, microbatch = schedule.actions[d][position[d]]
            ready, waiting = free[d], False
            for value, producer in inputs_of(kind, stage):
                if not 0 <= producer < S:
                    continue
                done = ended.get((made[value], producer, microbatch))
                if done is None:
                    waiting = True
                    break
                ready = max(ready, done + (transfer_in[max(producer, stage)] if producer != stage else 0.0))
            if waiting:
                continue
            if ready <= now:
                busy[d], left[d] = True, durations[kind][stage]
                starts[d].append(now)
            else:
                arrivals.append(ready)
        computing = [d for d in range(D) if busy[d]]
        if not computing and not arrivals:
            break
        rate = speed(len(computing) * group, world, cores)
        later = min([now + left[d] / rate for d in computing] + arrivals)
        elapsed, now = later - now, later
        for d in computing:
            left[d] -= elapsed * rate
            if left[d] > _DONE:
                continue
            stage, kind, microbatch = schedule.actions[d][position[d]]
            ended[kind, stage, microbatch] = now
            ends[d].append(now)
            free[d], busy[d] = now, False
            position[d] += 1
    stuck = [d for d in range(D) if position[d] < len(schedule.actions[d])]
    if stuck:
        raise ValueError(f"replay_shared: ranks {stuck} wait for inputs that never come (validate the schedule)")
    return starts, ends
