"""``--schedule auto``: the fastest schedule whose held activations fit a per-rank limit (pure Python).

Given each stage's forward, input-backward and weight-backward times (T_F, T_I, T_W: measured or
from the cost model), the transfer time and a limit on held activations per rank (in
microbatches' worth of one whole stage), ``synthesize`` simulates candidates and keeps the one
with the smallest step time whose peak fits. The candidates: every named schedule of the family
(so the result is never worse than the best of them under the same limit), and — planned with
the given costs, as the zero-bubble paper's automatic scheduler is (Qi et al. 2024a §3.2) — the
list scheduler (``schedules.greedy``) on the contiguous, V and loop (v = 2) placements at
admission limits 1, 1.5, …, 2K, and the repeated compact block (``schedules.periodic``) on each
placement. ``pareto`` keeps, of all of them, those no other beats on both step and peak.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

from modelpar._validate import check_int, check_number
from modelpar.schedules.action import Kind
from modelpar.schedules.greedy import greedy
from modelpar.schedules.memory import peak_held
from modelpar.schedules.periodic import periodic
from modelpar.schedules.registry import get_schedule, schedule_entry, schedule_names
from modelpar.schedules.replay import replay_times
from modelpar.schedules.schedule import Schedule, contiguous_map, loop_map, v_map
from modelpar.simulate.timeline import Timeline

__all__ = ["MAX_SYNTHESIS_WORK", "StageCosts", "candidates", "check_synthesis_size", "pareto", "synthesize"]

# The synthesis simulates about 12·K candidates (4K − 1 admission limits on each of 3 placements), each of
# 3·K·M·v actions the list scheduler places while looking over the K ranks: work grows as K³·M. Up to this
# bound (K = 16, M = 128; K = 32, M = 16) it answers within seconds; beyond it, minutes.
MAX_SYNTHESIS_WORK = 1 << 19


@dataclass(frozen=True)
class StageCosts:
    """T_F, T_I, T_W of each of the K whole stages (model order), and one transfer's time.

    A schedule with v chunks per rank cuts each whole stage into v virtual stages: virtual
    stage s takes 1/v of whole stage ⌊s / v⌋'s times.
    """

    forward: tuple[float, ...]
    input_grad: tuple[float, ...]
    weight_grad: tuple[float, ...]
    transfer: float = 0.0

    def __post_init__(self) -> None:
        lists = {"forward": self.forward, "input_grad": self.input_grad, "weight_grad": self.weight_grad}
        for name, xs in lists.items():
            object.__setattr__(self, name, tuple(check_number(f"{name}[{i}]", x) for i, x in enumerate(xs)))
        if not len(self.forward) == len(self.input_grad) == len(self.weight_grad) >= 1:
            raise ValueError(f"forward, input_grad and weight_grad need one time per stage each, got "
                             f"{len(self.forward)}, {len(self.input_grad)} and {len(self.weight_grad)}")
        check_number("transfer", self.transfer)

    @classmethod
    def uniform(cls, stages: int, forward: float = 1.0, input_grad: float = 1.0, weight_grad: float = 1.0,
                transfer: float = 0.0) -> StageCosts:
        k = check_int("stages", stages, minimum=1)
        return cls((forward,) * k, (input_grad,) * k, (weight_grad,) * k, transfer)

    @property
    def stages(self) -> int:
        return len(self.forward)

    def per_kind(self) -> dict[Kind, float]:
        """T_F, T_I, T_W of a whole stage, the mean over the stages: the ``costs=`` a cost-aware
        generator (``registry.get_schedule``) plans with."""
        k = self.stages
        return {Kind.F: sum(self.forward) / k, Kind.I: sum(self.input_grad) / k, Kind.W: sum(self.weight_grad) / k}

    def durations(self, schedule: Schedule) -> dict[Kind, list[float]]:
        """Time of each kind on each virtual stage of ``schedule`` (B = I + W)."""
        n, k = schedule.num_stages, self.stages
        if n % k:
            raise ValueError(f"a schedule of {n} stages cannot cut {k} stages' costs evenly")
        v = n // k
        per = {Kind.F: self.forward, Kind.I: self.input_grad, Kind.W: self.weight_grad,
               Kind.B: tuple(i + w for i, w in zip(self.input_grad, self.weight_grad))}
        return {kind: [xs[s // v] / v for s in range(n)] for kind, xs in per.items()}

    def transfer_in(self, schedule: Schedule) -> list[float]:
        dev = schedule.stage_to_rank
        return [0.0] + [self.transfer if dev[s] != dev[s - 1] else 0.0 for s in range(1, len(dev))]

    def timeline(self, schedule: Schedule) -> Timeline:
        """Simulate ``schedule`` under these costs."""
        starts, ends = replay_times(schedule, self.durations(schedule), self.transfer_in(schedule))
        return Timeline(schedule.actions, starts, ends, schedule)


def candidates(ranks: int, microbatches: int, costs: StageCosts, chunks: Collection[int] = (1, 2),
               ) -> Iterator[Schedule]:
    """The named family at (K, M) where it applies, then the list scheduler and repeated blocks; only
    those with v in ``chunks`` (a model too short for 2K chunks, or a split given per stage, allows v = 1 only)."""
    k, m = check_int("ranks", ranks, minimum=1), check_int("microbatches", microbatches, minimum=1)
    for name in schedule_names():
        entry = schedule_entry(name)
        v = entry.default_chunks
        if v in chunks and entry.microbatches.allows(m, k, v):
            yield get_schedule(name, ranks=k, microbatches=m, chunks=v, costs=costs.per_kind())
    for placement in (contiguous_map(k), v_map(k), loop_map(k, 2)):
        if len(placement) // k not in chunks:
            continue
        probe = Schedule(placement, tuple(() for _ in range(k)))
        durations, transfer_in = costs.durations(probe), costs.transfer_in(probe)
        yield periodic(placement, m, name="auto")
        for x in range(2, 4 * k + 1):
            yield greedy(placement, m, x / 2, durations=durations, transfer_in=transfer_in, name="auto")


def check_synthesis_size(ranks: int, microbatches: int, ranks_flag: str = "--ranks",
                         microbatches_flag: str = "--microbatches") -> None:
    """ValueError naming the flags when K³·M passes ``MAX_SYNTHESIS_WORK`` (a synthesis that would run for minutes)."""
    work = ranks ** 3 * microbatches
    if work > MAX_SYNTHESIS_WORK:
        raise ValueError(f"the schedule synthesis (auto, --pareto) grows as K^3·M ({ranks_flag}^3 x "
                         f"{microbatches_flag}) and answers in seconds up to {MAX_SYNTHESIS_WORK:,} (K = 16, M = 128; "
                         f"K = 32, M = 16), got K = {ranks}, M = {microbatches}: {work:,}; use fewer {ranks_flag} "
                         f"or {microbatches_flag}")


@functools.lru_cache(maxsize=64)  # the planner prices a layout, then predicts it: the same call twice
def synthesize(ranks: int, microbatches: int, costs: StageCosts, limit: float | None = None,
               chunks: Collection[int] = (1, 2)) -> tuple[Schedule, Timeline]:
    """The fastest candidate whose peak held activations per rank are ≤ ``limit`` (None: any).

    ValueError naming the smallest limit that works when none fits. The result is named "auto"
    when a synthesised candidate wins, else keeps the winning schedule's name. ``chunks``: the v
    allowed (``candidates``; a tuple: the result is cached).
    """
    if costs.stages != ranks:
        raise ValueError(f"costs must give {ranks} stages' times (one per stage), got {costs.stages}")
    if limit is not None:
        check_number("limit", limit, strict=True)
    best: tuple[float, Schedule, Timeline] | None = None
    smallest = float("inf")
    for s in candidates(ranks, microbatches, costs, chunks):
        peak = max(peak_held(s.actions, s.chunks))
        smallest = min(smallest, peak)
        if limit is not None and peak > limit + 1e-9:
            continue
        tl = costs.timeline(s)
        if best is None or tl.step_time < best[0] - 1e-12:
            best = (tl.step_time, s, tl)
    if best is None:
        raise ValueError(f"memory limit must be >= {smallest:g} microbatches' activations per rank (the least "
                         f"any schedule for K = {ranks}, M = {microbatches} holds), got {limit:g}")
    return best[1], best[2]


def pareto(timelines: Sequence[Timeline]) -> list[Timeline]:
    """The timelines no other beats on both step time and peak held activations, by increasing peak."""
    points = sorted(timelines, key=lambda t: (max(t.peak_held), t.step_time))
    front: list[Timeline] = []
    for t in points:
        if not front or t.step_time < front[-1].step_time - 1e-12:
            front.append(t)
    return front
