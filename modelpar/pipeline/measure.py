"""Turn a real run into the simulator's objects: a measured ``Timeline``, and a prediction from it.

The runtime records every action's start and end on every rank; ``gather_timeline`` collects
them into the same ``Timeline`` the simulator produces, so the ASCII / PNG / trace renderers draw
the real run. ``measured_durations`` averages the run's cost of each (kind, stage);
``measure_link`` times messages of a few sizes between two devices of the group (ping-pong) and
fits latency + bytes / bandwidth; ``simulate_measured`` feeds both back to the simulator: the step time and
bubble the schedule *should* have had with these compute and transfer costs, to set beside the
measured ones.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from modelpar.schedules.action import Action, Kind
from modelpar.schedules.replay import replay_times
from modelpar.schedules.schedule import Schedule
from modelpar.simulate.timeline import CommSpan, Event, Timeline

if TYPE_CHECKING:
    from modelpar.pipeline.runner import PipelineRunner

__all__ = ["Link", "gather_timeline", "measure_link", "measured_durations", "measured_timeline", "message_bytes",
           "message_delays", "simulate_measured", "transfer_times"]


def measured_timeline(runner: PipelineRunner, comm: Sequence[tuple[str, float, float]] = ()) -> Timeline:
    """Collective over the runner's group: every rank's measured events of its last step, as a Timeline.

    ``comm``: this rank's (label, start, end) of other communication in that step (the trainer's
    data-parallel collectives), in the step's clock (``runner.timer``'s marks).
    """
    spans = [(c, s + runner.clock, e + runner.clock) for c, s, e in comm]
    return gather_timeline(runner.record.events, runner.schedule, runner.group, runner.timeout, runner.recorder, spans)


def message_bytes(runner: PipelineRunner) -> list[float]:
    """Bytes of one message into each stage (its activation, and the gradient going back), the mean
    over microbatches; 0 where the stage before is on the same device. After a step."""
    dev = runner.schedule.stage_to_rank
    out = [0.0] * len(dev)
    for s in range(1, len(dev)):
        if dev[s] != dev[s - 1]:
            specs = runner.output_specs(s - 1)
            out[s] = sum(_nbytes(spec) for spec in specs) / len(specs)
    return out


def transfer_times(runner: PipelineRunner, repeats: int = 10) -> list[float]:
    """Collective: time messages on the runner's group (ping-pong, latency + bytes/bandwidth) and
    return one message's time into each stage — the ``transfer_in`` of ``simulate_measured``."""
    nbytes = message_bytes(runner)
    largest = max(nbytes, default=0.0)
    link = measure_link(runner.group, [64, int(largest) // 4, int(largest)], runner.timeout, runner.recorder, repeats)
    return [link.time(b) if b else 0.0 for b in nbytes]


def _nbytes(spec: tuple[tuple[int, ...], Any]) -> float:
    import torch

    shape, dtype = spec
    return float(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size())


def gather_timeline(events: Sequence[tuple[Action, float, float]], schedule: Schedule, group: Any,
                    timeout: float, recorder: Any, comm: Sequence[tuple[str, float, float]] = ()) -> Timeline:
    """Collective over ``group``: every rank's (action, start, end) of one step, and its
    communication spans (label, start, end) on the same clock, as a Timeline.

    The actions travel as they are (an ``Action`` is a named tuple and pickles), not as text to parse again."""
    from modelpar.pipeline.bounded_comm import all_gather_object

    mine = ([(a, float(s), float(e)) for a, s, e in events], [(str(c), float(s), float(e)) for c, s, e in comm])
    everyone = all_gather_object(mine, group, timeout, "the timeline gather", recorder)
    return Timeline.from_events(
        [Event(d, a, s, e) for d, (rows, _) in enumerate(everyone) for a, s, e in rows],
        schedule.num_ranks,
        schedule,
        unit="s",
        comm=[CommSpan(d, c, s, e) for d, (_, spans) in enumerate(everyone) for c, s, e in spans],
    )


def measured_durations(timelines: Iterable[Timeline]) -> dict[Kind, list[float]]:
    """Mean duration of each kind on each virtual stage over all ``timelines`` (seconds).

    The mean, not the median: it keeps each device's total work, so a prediction from it has
    the busy time the run had (on a loaded machine a few preempted actions carry much of it).
    """
    timelines = list(timelines)
    if not timelines:
        raise ValueError("timelines must hold at least one measured timeline, got none")
    stages = len(timelines[0].stage_to_rank)
    samples: dict[Kind, list[list[float]]] = {k: [[] for _ in range(stages)] for k in Kind}
    for tl in timelines:
        for e in tl.events:
            samples[e.action.kind][e.action.stage].append(e.end - e.start)
    return {k: [statistics.fmean(x) if x else 0.0 for x in per_stage] for k, per_stage in samples.items()}


def message_delays(timelines: Iterable[Timeline]) -> list[float]:
    """Mean time a message into each stage boundary took in the run itself (seconds; 0: same device).

    For every cross-device dependency whose consumer's device sat idle from before the producer
    ended, the consumer's start minus the producer's end is what that message cost on the
    critical path: wire time plus waking the receiver. Unlike a ping-pong's median this includes
    the slow wake-ups a loaded machine gives a waiting process. Both directions are pooled, as
    the simulator charges ``transfer_in[s]`` to the activation into stage s and the gradient back.
    """
    timelines = list(timelines)
    if not timelines or timelines[0].schedule is None:
        raise ValueError("timelines must hold at least one measured timeline with its schedule")
    schedule = timelines[0].schedule
    dev = schedule.stage_to_rank
    samples: list[list[float]] = [[] for _ in dev]
    for tl in timelines:
        where = {a: (d, i) for d, acts in enumerate(tl.actions) for i, a in enumerate(acts)}
        for a, (d, i) in where.items():
            for dep in schedule.dependencies(a):
                pd, pi = where[dep]
                if pd == d:
                    continue
                produced, started = tl.ends[pd][pi], tl.starts[d][i]
                idle_since = tl.ends[d][i - 1] if i else 0.0
                if idle_since <= produced <= started:
                    samples[max(a.stage, dep.stage)].append(started - produced)
    return [statistics.fmean(x) if x and s and dev[s] != dev[s - 1] else 0.0 for s, x in enumerate(samples)]


@dataclass(frozen=True)
class Link:
    """One message's time between two pipeline devices: ``latency + bytes · seconds_per_byte``."""

    latency: float  # seconds
    seconds_per_byte: float

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes * self.seconds_per_byte


def measure_link(group: Any, sizes: Sequence[int], timeout: float, recorder: Any, repeats: int = 10) -> Link:
    """Collective: ping-pong messages of ``sizes`` bytes between devices 0 and 1, fit latency + bytes/bandwidth.

    One-way time = half the median round trip; least squares over the sizes. Every rank returns
    device 0's fit. With fewer than two devices, or ``group`` None, there is no link: zero.
    """
    if group is None:
        return Link(0.0, 0.0)
    import torch
    import torch.distributed as dist

    from modelpar.pipeline.bounded_comm import broadcast_object, comm_device, is_nccl, wait

    if dist.get_world_size(group) < 2:
        return Link(0.0, 0.0)
    me, ranks, nccl = dist.get_rank(group), dist.get_process_group_ranks(group), is_nccl(group)
    sizes = sorted({int(s) for s in sizes})
    one_way = []
    for size in sizes:
        buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=comm_device(group))
        times = []
        for i in range(repeats + 2):
            start = time.perf_counter()
            if me in (0, 1):
                ops = (dist.isend, dist.irecv) if me == 0 else (dist.irecv, dist.isend)
                for op in ops:
                    wait(op(buf, ranks[1 - me], group=group), timeout, "the link ping-pong", recorder, nccl)
            if i >= 2:
                times.append(time.perf_counter() - start)
        one_way.append(statistics.median(times) / 2)
    fit = None
    if me == 0:
        if len(sizes) > 1:
            slope, intercept = statistics.linear_regression([float(s) for s in sizes], one_way)
            fit = (max(intercept, 0.0), max(slope, 0.0))
        else:
            fit = (one_way[0], 0.0)
    latency, per_byte = broadcast_object(fit, 0, group, timeout, "the link fit", recorder)
    return Link(latency, per_byte)


def simulate_measured(schedule: Schedule, durations: Mapping[Kind, Sequence[float]],
            transfer_in: Sequence[float] | float = 0.0) -> Timeline:
    """Simulate ``schedule`` with measured per-(kind, stage) ``durations`` and transfer times.

    ``transfer_in[s]`` is one message's time into stage s (activation in, gradient back; 0 on
    the same device), e.g. from ``PipelineRunner.transfer_times``; a number applies to every
    boundary that crosses devices.
    """
    dev = schedule.stage_to_rank
    if isinstance(transfer_in, (int, float)):
        transfer_in = [float(transfer_in) if s and dev[s] != dev[s - 1] else 0.0 for s in range(len(dev))]
    starts, ends = replay_times(schedule, durations, transfer_in)
    return Timeline(schedule.actions, starts, ends, schedule, unit="s")
