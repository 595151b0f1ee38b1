"""The planner for ``modelpar train --plan auto``: every layout the trainer can run on W ranks, ranked by
predicted step time, those whose most loaded rank does not fit the memory limit set aside.

What the trainer can run is one list, ``Capabilities`` (schedules, ZeRO stages, recomputations,
activation offload (tried only on a layout that does not fit without it, the fewest layers that make it fit),
sequence parallelism, interleaving, microbatch counts, context parallelism's modes); context-parallel
layouts are those ``specs.check_trainer_context`` accepts (the trainer's own rule: a sequence in 2·cp
chunks, ZeRO 0 or 1, s/cp over t under sequence parallelism); the command fills it from the trainer's
own choices (``TrainConfig``'s schedule and ZeRO lists) and its ``TrainConfig.check`` accepts or
refuses each candidate, so a new capability there is a new entry here. The axes' values and rules (t, cp, p,
the microbatch counts, ep, SP, ZeRO) and the loop over them (``axes.walk``, in the order ``axes.LOCAL``) are
``costmodel.axes``', which ``search.py`` walks too (``_Trainer`` holds this planner's hooks); which of them
the trainer runs together (ZeRO with ep, ...) is ``accept``'s. Pure Python.

``auto`` among the schedules: for each (t, p, d, m, recomputation, SP, ZeRO) with p > 1, the
schedule ``simulate.synthesis`` builds from this layout's stage costs (``local.stage_costs``)
within the held activations the byte limit leaves (``held_limit``), of the v that ``accept``
allows; the trainer rebuilds the same one from ``LocalLayout.memory_limit`` (``local.layout_schedule``).
``why_schedule`` says why the plan's schedule beats 1F1B at the same layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from modelpar.costmodel.allocator import allocator_bytes
from modelpar.costmodel.axes import LOCAL, Axis, Chosen, Outcome, Planner, walk
from modelpar.costmodel.inventory import stage_tensors
from modelpar.costmodel.local import LocalPrediction, auto_schedule, predict_local
from modelpar.costmodel.local_memory import LocalLayout, activation_bytes, state_bytes
from modelpar.costmodel.profiles import HardwareProfile
from modelpar.costmodel.specs import CP_COMMS, PLANNED_RECOMPUTE, ModelSpec, check_trainer_context
from modelpar.schedules.registry import BASELINE, COMPARED, schedule_entry
from modelpar.schedules.schedule import contiguous_map, loop_map, v_map

__all__ = ["Capabilities", "LocalPlan", "held_limit", "pinned", "plan_local", "why_ep", "why_schedule"]


@dataclass(frozen=True)
class Capabilities:
    """What the trainer runs today; extend an entry when it learns more (uneven stages, ...)."""

    schedules: tuple[str, ...] = COMPARED
    zero: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = PLANNED_RECOMPUTE
    sequence_parallel: bool = True
    chunks: tuple[int, ...] = (2, 4)  # v tried with the interleaved schedule
    max_microbatches: int = 16
    cp_comms: tuple[str, ...] = CP_COMMS  # context parallelism's modes tried at cp > 1 (none: cp = 1 only)
    offload: bool = True  # activation offload: tried on a layout only when it does not fit without it


@dataclass(frozen=True)
class LocalPlan:
    """The ranked layouts that fit, and the leanest of those that did not (for the refusal)."""

    ranked: list[tuple[LocalLayout, LocalPrediction]]
    leanest: tuple[LocalLayout, LocalPrediction] | None
    tried: int


def layouts(model: ModelSpec, world: int, batch: int, caps: Capabilities, base: LocalLayout) -> Iterator[LocalLayout]:
    """Every (t, cp, p, d, schedule, v, m, recompute, SP, ZeRO, ep) of ``caps`` on ``world`` ranks, ``base``'s other
    fields."""
    trainer = _Trainer(model, batch, caps, base)
    walk(trainer, {"world": world, "batch": batch, "seq": model.seq, "moe": base.moe})
    yield from trainer.found


class _Trainer(Planner):
    """The trainer's walk of the axes: ``caps`` narrows them, the schedule registry's rules, no pruning; the leaf
    keeps each layout whose ZeRO buckets and context parallelism the trainer runs."""

    order = LOCAL

    def __init__(self, model: ModelSpec, batch: int, caps: Capabilities, base: LocalLayout) -> None:
        self.model, self.batch, self.caps, self.base = model, batch, caps, base
        self.found: list[LocalLayout] = []

    def options(self, axis: Axis, c: Chosen) -> Sequence[Any]:
        """The axis's values as ``caps`` narrows them (cp > 1: each of its modes; the schedules' own v)."""
        name, caps, values = axis.name, self.caps, axis.values(c)
        if name == "cp_comm":
            return values if c["cp"] == 1 else caps.cp_comms
        if name == "v":
            return _chunk_choices(c["schedule"], caps)
        if name == "microbatches":
            return [m for m in values if m <= caps.max_microbatches]
        if name == "sequence_parallel":
            return values if caps.sequence_parallel else (False,)
        if name == "zero":  # ``caps.zero``'s that shard over ranks (``axes.shards``)
            return [z for z in caps.zero if z in values]
        return {"schedule": caps.schedules, "recompute": caps.recompute}.get(name, values)

    def valid(self, name: str, c: Chosen) -> bool:
        """d divides the batch; one stage runs one schedule (every schedule is the same loop); the layers fill the
        p·v chunks (auto: its v is chosen in ``plan_local``); the schedule takes (p, m, v)."""
        if name == "d":
            return self.batch % c["d"] == 0
        if name == "schedule":
            return c["p"] > 1 or c["schedule"] == BASELINE
        if name == "v":
            return self.model.layers % (c["p"] * c["v"]) == 0 or c["schedule"] == "auto"
        return _builds(c["schedule"], c["p"], c["microbatches"], c["v"]) if name == "microbatches" else True

    def leaf(self, c: Chosen) -> Outcome:
        """Keep the layout if the trainer runs its ZeRO buckets and its context parallelism."""
        run = replace(self.base, model=self.model, batch=self.batch, **{n: c[n] for n in self.order})
        if _shards_fit(run) and _context_runs(self.model, run.cp, run.zero, run.t, run.sequence_parallel):
            self.found.append(run)
        return None


def _context_runs(model: ModelSpec, cp: int, zero: int, t: int, sp: bool) -> bool:
    try:
        check_trainer_context(model.seq, cp, zero, t, sp)
    except ValueError:
        return False
    return True


def _chunk_choices(schedule: str, caps: Capabilities) -> tuple[int, ...]:
    """The v to try with ``schedule``: ``caps.chunks`` for one that takes any, its own v otherwise (auto: 1 here,
    its v is chosen in ``plan_local``)."""
    if schedule == "auto":
        return (1,)
    fixed = schedule_entry(schedule).chunks
    return caps.chunks if fixed is None else (fixed,)


def _shards_fit(run: LocalLayout) -> bool:
    """Under ZeRO-2/3 a bucket must hold one data-parallel shard of the largest parameter (the trainer refuses
    the run otherwise: ``training.zero_grads.check_bucket_size``)."""
    if run.zero < 2:
        return True
    largest = max(x.numel for s in range(run.stages) for x in stage_tensors(run, s))
    return -(-largest // run.grad_ranks) <= run.bucket_elements


def _builds(schedule: str, p: int, m: int, v: int) -> bool:
    """Whether ``schedule`` takes (p, m, v): its registry entry's microbatch rule (interleaved p | m, DualPipe-V
    m >= 2p, ...)."""
    return schedule == "auto" or schedule_entry(schedule).microbatches.allows(m, p, v)


def held_limit(run: LocalLayout, limit_bytes: float, chunks: tuple[int, ...], gpu: bool = False) -> float:
    """Most held activations per device (microbatches of a whole stage) that keep every rank of ``run`` within
    ``limit_bytes``, for any placement of the v in ``chunks`` (contiguous; V or loop): the least over them.
    ``gpu``: with what the allocator holds besides (``costmodel.allocator``), as ``predict_local`` counts it there."""
    least = float("inf")
    for v in chunks:
        one = replace(run, v=v)
        for placement in ((contiguous_map(run.p),) if v == 1 else (v_map(run.p), loop_map(run.p, v))):
            for rank in range(run.p):
                stages = [s for s, dev in enumerate(placement) if dev == rank]
                per_held = v * sum(activation_bytes(one, s) for s in stages) / len(stages)
                room = limit_bytes - sum(state_bytes(one, stages).values())
                if gpu:
                    room -= allocator_bytes(one, stages).peak()
                if per_held > 0:
                    least = min(least, room / per_held)
                elif room < 0:  # holds no activations (layerless chunks) but not even its state fits
                    least = -float("inf")
    return least


def _auto(run: LocalLayout, hw: HardwareProfile, limit_bytes: float, accept: Callable[[LocalLayout], bool],
          ) -> LocalLayout | None:
    """``run`` (schedule auto) with the v and held limit of the schedule synthesised within ``limit_bytes``;
    None if no v is accepted or no schedule fits. v only where the layers fill the p·v chunks evenly (the
    synthesis cuts a stage's costs evenly), as the trainer's ``prediction.resolve_schedule`` allows."""
    chunks = tuple(v for v in (1, 2) if run.model.layers % (run.p * v) == 0 and accept(replace(run, v=v)))
    if not chunks:
        return None
    limit = held_limit(run, limit_bytes, chunks, gpu=hw.device != "cpu")
    if limit <= 0:
        return None
    run = replace(run, memory_limit=limit)
    try:
        schedule, _ = auto_schedule(run, hw, chunks)
    except ValueError:  # below what any schedule holds
        return None
    return replace(run, v=schedule.chunks)


def _offloaded(run: LocalLayout, pred: LocalPrediction, hw: HardwareProfile, limit_bytes: float,
               accept: Callable[[LocalLayout], bool]) -> tuple[LocalLayout, LocalPrediction]:
    """``run`` with the least activation offload that fits ``limit_bytes`` (the first n layers of each stage, n
    from 1, then all: the fewest bytes copied), or ``run`` as it was when none does. Full recomputation keeps
    nothing in the layers to move."""
    per = run.model.layers // run.stages
    if run.recompute == "full" or not per:
        return run, pred
    for choice in [str(n) for n in range(1, per)] + ["all"]:
        trial = replace(run, offload=choice)
        got = predict_local(trial, hw)
        if got.memory_bytes <= limit_bytes and accept(trial):
            return trial, got
    return run, pred


def pinned(run: LocalLayout, pins: Mapping[str, Any], later: tuple[str, ...] = ()) -> bool:
    """Whether ``run`` keeps every pinned field's value (``LocalLayout`` names; as ``modelpar plan``'s pins fix a
    dimension of its search, the user's layout flags fix this one's); ``later``: fields not chosen yet."""
    return all(getattr(run, name) == value for name, value in pins.items() if name not in later)


def plan_local(base: LocalLayout, world: int, hw: HardwareProfile, limit_bytes: float, caps: Capabilities = Capabilities(),
               accept: Callable[[LocalLayout], bool] = lambda run: True, pins: Mapping[str, Any] | None = None,
               ) -> LocalPlan:
    """Predict every layout ``accept`` allows that keeps the ``pins``; rank those whose busiest rank fits
    ``limit_bytes``, fastest first."""
    ranked, leanest, tried = [], None, 0
    pins = pins or {}
    for run in layouts(base.model, world, base.batch, caps, base):
        if not pinned(run, pins, later=("v",) if run.schedule == "auto" else ()):
            continue
        if run.schedule == "auto":
            found = _auto(run, hw, limit_bytes, lambda r: pinned(r, pins) and accept(r))  # a pinned v, if any
            if found is None:
                continue
            run = found
        if not (pinned(run, pins) and accept(run)):
            continue
        tried += 1
        pred = predict_local(run, hw)
        if pred.memory_bytes > limit_bytes and caps.offload and "offload" not in pins:
            run, pred = _offloaded(run, pred, hw, limit_bytes, lambda r: pinned(r, pins) and accept(r))
        if pred.memory_bytes <= limit_bytes:
            ranked.append((run, pred))
        elif leanest is None or pred.memory_bytes < leanest[1].memory_bytes:
            leanest = (run, pred)
    ranked.sort(key=lambda x: (x[1].step_time_s, x[1].memory_bytes))
    return LocalPlan(ranked, leanest, tried)


def why_schedule(plan: LocalPlan, run: LocalLayout, pred: LocalPrediction) -> str:
    """Why the plan runs ``run``'s schedule: its bubble and bytes beside 1F1B's at the same layout (or why not 1F1B)."""
    name = "auto (synthesised)" if run.schedule == "auto" else run.schedule
    name += f", v={run.v}" if run.v > 1 else ""
    if run.p == 1:
        return "one pipeline stage: no schedule to choose"
    same = [(r, p) for r, p in plan.ranked if r.schedule == BASELINE and
            replace(r, schedule=run.schedule, v=run.v, memory_limit=run.memory_limit) == run]
    mib = lambda x: f"{x / 2**20:,.2f}"  # noqa: E731
    if run.schedule == BASELINE:
        return f"{BASELINE}: no schedule of the family, nor auto, is faster at this layout within the limit"
    if not same:
        return f"{name}: {100 * pred.bubble:.1f}% bubble; {BASELINE} does not fit the limit at this layout"
    base = same[0][1]
    return (f"{name}: {100 * pred.bubble:.1f}% bubble vs {BASELINE} {100 * base.bubble:.1f}%, step "
            f"{1e3 * pred.step_time_s:,.2f} vs {1e3 * base.step_time_s:,.2f} ms, busiest rank "
            f"{mib(pred.memory_bytes)} vs {mib(base.memory_bytes)} MiB")


def why_ep(plan: LocalPlan, run: LocalLayout, pred: LocalPrediction) -> str:
    """Why the plan's expert parallelism: the fastest plan at every other ep beside it ("" for a dense model)."""
    if run.moe is None:
        return ""
    best: dict[int, LocalPrediction] = {}
    for r, p in plan.ranked:  # fastest first
        best.setdefault(r.ep, p)
    others = [f"ep={e} {100 * (p.step_time_s / pred.step_time_s - 1):+.1f}% step, busiest rank "
              f"{p.memory_bytes / 2**20:,.2f} MiB" for e, p in sorted(best.items()) if e != run.ep]
    what = (f"ep={run.ep}: {run.moe.experts // run.ep} of {run.moe.experts} experts per rank, "
            f"busiest rank {pred.memory_bytes / 2**20:,.2f} MiB")
    return what + (" vs the best at " + "; ".join(others) if others else "; no other ep fits or is accepted")
