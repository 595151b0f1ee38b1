"""The planner for ``modelpar train --plan auto``: every layout the trainer can run on W ranks, ranked by
predicted step time, those whose most loaded rank does not fit the memory limit set aside.

What the trainer can run is one list, ``Capabilities`` (schedules, ZeRO stages, recomputations,
sequence parallelism, interleaving, microbatch counts); the command fills it from the trainer's
own choices (``TrainConfig``'s schedule and ZeRO lists) and its ``TrainConfig.check`` accepts or
refuses each candidate, so a new capability there is a new entry here. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from modelpar.costmodel.local import LocalPrediction, predict_local
from modelpar.costmodel.local_memory import LocalRun, stage_tensors
from modelpar.costmodel.profiles import HardwareProfile
from modelpar.costmodel.search import divisors
from modelpar.costmodel.specs import PLANNED_RECOMPUTE, ModelSpec
from modelpar.schedules.generators import CHUNKED, V_SHAPED, get_schedule

__all__ = ["Capabilities", "LocalPlan", "plan_local"]


@dataclass(frozen=True)
class Capabilities:
    """What the trainer runs today; extend an entry when it learns more (uneven stages, ...)."""

    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1")
    zero: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = PLANNED_RECOMPUTE
    sequence_parallel: bool = True
    chunks: tuple[int, ...] = (2, 4)  # v tried with the interleaved schedule
    max_microbatches: int = 16


@dataclass(frozen=True)
class LocalPlan:
    """The ranked layouts that fit, and the leanest of those that did not (for the refusal)."""

    ranked: list[tuple[LocalRun, LocalPrediction]]
    leanest: tuple[LocalRun, LocalPrediction] | None
    tried: int


def layouts(model: ModelSpec, world: int, batch: int, caps: Capabilities, base: LocalRun) -> Iterator[LocalRun]:
    """Every (t, p, d, schedule, v, m, recompute, SP, ZeRO) of ``caps`` on ``world`` ranks, ``base``'s other fields."""
    for t in divisors(world):
        for p in divisors(world // t):
            d = world // (t * p)
            if batch % d:
                continue
            for schedule in caps.schedules:
                if p == 1 and schedule != "1f1b":
                    continue  # one stage: every schedule is the same loop
                for v in (caps.chunks if schedule in CHUNKED else (2,) if schedule in V_SHAPED else (1,)):
                    if model.layers % (p * v):
                        continue
                    for m in (x for x in divisors(batch // d) if x <= caps.max_microbatches):
                        if not _builds(schedule, p, m, v):
                            continue
                        for rc in caps.recompute:
                            for sp in ((False, True) if caps.sequence_parallel and t > 1 else (False,)):
                                for zero in (z for z in caps.zero if z == 0 or d > 1):
                                    run = replace(base, model=model, t=t, p=p, d=d, schedule=schedule, v=v,
                                                  microbatches=m, batch=batch, recompute=rc, sequence_parallel=sp,
                                                  zero=zero)
                                    if _shards_fit(run):
                                        yield run


def _shards_fit(run: LocalRun) -> bool:
    """Under ZeRO-2/3 a bucket must hold one data-parallel shard of the largest parameter (the trainer refuses
    the run otherwise: ``training.zero_grads.check_bucket_size``)."""
    if run.zero < 2:
        return True
    largest = max(x.numel for s in range(run.stages) for x in stage_tensors(run, s))
    return -(-largest // run.d) <= run.bucket_elements


def _builds(schedule: str, p: int, m: int, v: int) -> bool:
    """Whether the generator makes ``schedule`` for (p, m, v) (interleaved needs p | m, DualPipe-V m >= 2p, ...)."""
    try:
        get_schedule(schedule, stages=p, microbatches=m, chunks=v)
    except ValueError:
        return False
    return True


def plan_local(base: LocalRun, world: int, hw: HardwareProfile, limit_bytes: float, caps: Capabilities = Capabilities(),
               accept: Callable[[LocalRun], bool] = lambda run: True) -> LocalPlan:
    """Predict every layout ``accept`` allows; rank those whose busiest rank fits ``limit_bytes``, fastest first."""
    ranked, leanest, tried = [], None, 0
    for run in layouts(base.model, world, base.batch, caps, base):
        if not accept(run):
            continue
        tried += 1
        pred = predict_local(run, hw)
        if pred.memory_bytes <= limit_bytes:
            ranked.append((run, pred))
        elif leanest is None or pred.memory_bytes < leanest[1].memory_bytes:
            leanest = (run, pred)
    ranked.sort(key=lambda x: (x[1].step_time_s, x[1].memory_bytes))
    return LocalPlan(ranked, leanest, tried)
