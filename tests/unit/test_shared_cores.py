"""Processor sharing (``simulate.shared_cores``): a pipeline whose processes outnumber the cores, timed with the
idle ranks' cores going to those computing. Hand-checked small cases, equality to ``replay_times`` when every
process has a core, bounds on every registry schedule, and the local cost model's use of it."""

import dataclasses
import random

import pytest

from modelpar.costmodel.local import _timeline
from modelpar.costmodel.local_memory import LocalLayout
from modelpar.costmodel.presets import CPU_DEFAULT
from modelpar.model import ModelConfig
from modelpar.schedules.action import Kind
from modelpar.schedules.registry import get_schedule, schedule_names
from modelpar.schedules.replay import replay_times
from modelpar.simulate.shared_cores import replay_shared, speed


def _schedules():
    """Every registry schedule that builds at (K, M, v)."""
    for name in schedule_names():
        for ranks, microbatches, chunks in ((2, 4, None), (4, 8, None), (4, 8, 2)):
            try:
                schedule = get_schedule(name, ranks=ranks, microbatches=microbatches, chunks=chunks)
            except ValueError:
                continue  # v fixed by the schedule
            yield pytest.param(schedule, id=f"{name}-K{ranks}-M{microbatches}-v{chunks or 1}")


SCHEDULES = list(_schedules())


def _costs(schedule, seed=0):
    rnd = random.Random(seed)
    durations = {k: [rnd.uniform(0.5, 2.0) for _ in range(schedule.num_stages)] for k in Kind}
    return durations, [0.0] + [rnd.uniform(0.0, 0.3) for _ in range(schedule.num_stages - 1)]


def test_speed():
    assert speed(4, world=4, cores=2) == 1.0  # everyone computes: the priced time
    assert speed(2, world=4, cores=2) == 2.0  # half idle: each computing process has a core
    assert speed(1, world=4, cores=2) == 2.0  # one process cannot use two cores
    assert speed(3, world=8, cores=2) == pytest.approx(4 / 1.5)
    assert speed(2, world=2, cores=4) == 1.0  # cores to spare: never faster than priced


def test_one_f_one_b_on_one_core_by_hand():
    """1F1B, K = 2, M = 2, F = 1, B = 2 priced with both ranks busy on one core (speed 2 alone, 1 together).
    Rank 0: F0 alone [0, 0.5]; F1 beside rank 1's F0 [0.5, 1.5]; rank 1's B0 alone [1.5, 2.5]; rank 0's B0 beside
    rank 1's F1 (ends 3.5) then B1 (from 3.5): 1 left at speed 1, ends 4.5; rank 1's B1: 1 done by 4.5, 1 left
    alone, ends 5.0; rank 0's B1 alone [5.0, 6.0]."""
    schedule = get_schedule("1f1b", ranks=2, microbatches=2)
    starts, ends = replay_shared(schedule, {Kind.F: [1.0, 1.0], Kind.B: [2.0, 2.0]}, [0.0, 0.0], group=1, cores=1)
    assert starts == [[0.0, 0.5, 2.5, 5.0], [0.5, 1.5, 2.5, 3.5]]
    assert ends == [[0.5, 1.5, 4.5, 6.0], [1.5, 2.5, 3.5, 5.0]]


def test_a_transfer_takes_its_time_whatever_the_load():
    """GPipe, K = 2, M = 1: one action at a time, each at twice its priced speed; the transfers (0.25 s into
    stage 1, the same back) do not speed up: 0.5 + 0.25 + 1.5 + 2 + 0.25 + 1 = 5.5."""
    schedule = get_schedule("gpipe", ranks=2, microbatches=1)
    starts, ends = replay_shared(schedule, {Kind.F: [1.0, 3.0], Kind.B: [2.0, 4.0]}, [0.0, 0.25], group=1, cores=1)
    assert starts == [[0.0, 4.5], [0.75, 2.25]]
    assert ends == [[0.5, 5.5], [2.25, 4.25]]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_with_a_core_for_every_process_it_is_the_replay(schedule):
    durations, transfer = _costs(schedule)
    assert replay_shared(schedule, durations, transfer, group=3, cores=3 * schedule.num_ranks) == \
        replay_times(schedule, durations, transfer)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_shared_cores_never_slower_than_priced_nor_faster_than_the_cores_allow(schedule):
    """Never slower than every process computing at once (the priced replay); never faster than that replay at
    the greatest speed, nor than all the work over the cores: each action's priced seconds at the full contention
    world / cores are that many seconds of ``group`` processes' ``cores / world`` of a core."""
    durations, transfer = _costs(schedule, seed=1)
    group, cores = 2, 2
    world = group * schedule.num_ranks
    _, priced = replay_times(schedule, durations, transfer)
    _, shared = replay_shared(schedule, durations, transfer, group=group, cores=cores)
    step, priced_step = max(map(max, shared)), max(map(max, priced))
    work = sum(durations[a.kind][a.stage] for rank in schedule.actions for a in rank)  # priced seconds, one rank
    assert step <= priced_step + 1e-9
    assert step >= priced_step / speed(1, world, cores) - 1e-9
    assert step >= work * group / world - 1e-9  # the cores' seconds: work·(cores/world)·group / cores


TINY = ModelConfig(hidden=32, heads=4, layers=4, seq_len=16).spec()
CPU = dataclasses.replace(CPU_DEFAULT, cores=2)


def _priced(run, hw):
    """The local model's timeline of ``run`` and the plain replay of the same priced actions."""
    schedule, costs, _, timeline = _timeline(run, hw)
    durations = {Kind.F: [c[0] for c in costs], Kind.B: [c[1] for c in costs]}
    hop = timeline.starts[-1][0] - timeline.ends[0][0] if schedule.num_ranks > 1 else 0.0  # F0 crossing over
    transfer = [0.0] + [hop] * (schedule.num_stages - 1)
    return schedule, durations, transfer, timeline


def test_the_cost_model_shares_cores_when_processes_outnumber_them():
    """t = 2, p = 2 on 2 cores (the default run's shape): the pipeline is timed with shared cores (2 processes per
    pipeline rank), faster than every action at its all-busy price; with a core per process it is the replay."""
    run = LocalLayout(TINY, t=2, p=2, microbatches=4, batch=16)
    schedule, durations, transfer, timeline = _priced(run, CPU)
    starts, ends = replay_shared(schedule, durations, transfer, group=2, cores=2)
    assert (timeline.starts, timeline.ends) == (starts, ends)
    assert timeline.step_time < max(map(max, replay_times(schedule, durations, transfer)[1]))
    schedule, durations, transfer, timeline = _priced(run, dataclasses.replace(CPU, cores=4))
    assert (timeline.starts, timeline.ends) == replay_times(schedule, durations, transfer)


def test_without_pipelining_every_process_computes_at_its_price():
    """t = 4 on 2 cores: all four compute all the time, so sharing the cores changes nothing."""
    schedule, durations, transfer, timeline = _priced(LocalLayout(TINY, t=4, microbatches=4, batch=16), CPU)
    assert timeline.ends == replay_times(schedule, durations, transfer)[1]
