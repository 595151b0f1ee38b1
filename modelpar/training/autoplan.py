"""``modelpar train --plan auto``: the planner picks the layout the trainer runs, before any process starts.

The candidates are ``costmodel.local_search``'s, restricted to what the trainer runs and the local
cost model prices: the trainer's schedule list, its ZeRO stages that ``costmodel.local`` prices
(``PRICED_ZERO``: 0–3, ZeRO-2/3's per-microbatch collectives included), context parallelism
(cp over the divisors of the world, ring and all-gather, where ``check_trainer_context`` allows), and
``TrainConfig.check`` must accept each one. Each is
priced on the run's hardware profile (``--hardware``, else the nominal CPU); the fastest whose
most loaded rank fits ``memory_limit_gb`` (default: the device's memory, a CPU host's shared by
its ranks) is run. None fitting is a one-line ValueError naming the stage and the bytes.

The layout settings the user gave (flags or ``--config``; ``PLANNED``) are pins, as ``modelpar plan``'s
are: the planner searches the rest (``local_search.pinned``) and the plan line names what it kept.
A ``--stage-layers`` split is refused with ``--plan auto`` (the planner prices its own p's default
split), as is ``--memory-limit`` (the planner sets schedule auto's limit from the bytes).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from modelpar._validate import check_int
from modelpar.costmodel.local import PRICED_ZERO, LocalPrediction
from modelpar.costmodel.local_memory import LocalLayout
from modelpar.costmodel.local_search import Capabilities, plan_local, why_ep, why_schedule
from modelpar.training.config import SCHEDULE_CHOICES, ZERO_CHOICES, TrainConfig
from modelpar.training.prediction import local_run, profile_of

__all__ = ["CAPABILITIES", "PLANNED", "auto_plan", "describe", "plan_world"]

CAPABILITIES = Capabilities(schedules=(*SCHEDULE_CHOICES, "auto"),
                            zero=tuple(z for z in ZERO_CHOICES if z in PRICED_ZERO))


# The TrainConfig fields the planner chooses, by their LocalLayout names: a flag given for one of them is a pin.
PLANNED = {"tp": "t", "pp": "p", "dp": "d", "cp": "cp", "cp_comm": "cp_comm", "schedule": "schedule", "chunks": "v",
           "microbatches": "microbatches", "recompute": "recompute", "sequence_parallel": "sequence_parallel",
           "zero": "zero", "ep": "ep", "offload_activations": "offload"}


def _config(cfg: TrainConfig, run: LocalLayout) -> TrainConfig:
    return replace(cfg, **{name: getattr(run, field) for name, field in PLANNED.items()}, memory_limit=run.memory_limit)


def _pins(cfg: TrainConfig, given: Iterable[str]) -> dict[str, Any]:
    """The planner's pins (LocalLayout names) from the settings the user gave (flags or ``--config``): each keeps its
    value. A ``--stage-layers`` split or a ``--memory-limit`` the planner does not price: one line, refused."""
    given = set(given)
    if cfg.stage_layers is not None:
        raise ValueError(f"--stage-layers {','.join(map(str, cfg.stage_layers))} with --plan auto: the planner prices "
                         "the default split of the p it picks; drop --stage-layers, or use --plan none")
    if "memory_limit" in given:
        raise ValueError(f"--memory-limit {cfg.memory_limit:g} with --plan auto: the planner sets schedule auto's "
                         "limit from --memory-limit-gb; drop --memory-limit")
    return {field: getattr(cfg, name) for name, field in PLANNED.items() if name in given}


def _flags(cfg: TrainConfig, pins: dict[str, Any]) -> str:
    """The pins as the flags that set them: ``--tp 2 --schedule zb-v``."""
    shown = {True: "on", False: "off"}
    return " ".join(f"--{name.replace('_', '-')} {shown.get(getattr(cfg, name), getattr(cfg, name))}"
                    for name, field in PLANNED.items() if field in pins)


def _accepted(cfg: TrainConfig, world: int, run: LocalLayout) -> bool:
    try:
        _config(cfg, run).check(world)
    except ValueError:
        return False
    return True


def describe(run: LocalLayout) -> str:
    sp = ", sequence parallel" if run.sequence_parallel else ""
    limit = f" (memory limit {run.memory_limit:.3g})" if run.schedule == "auto" else ""
    v = f", v={run.v}" if run.v > 1 else ""
    cp = f" cp={run.cp} ({run.cp_comm})" if run.cp > 1 else ""
    ep = f" ep={run.ep}" if run.ep > 1 else ""
    offload = f", offload activations {run.offload}" if run.offload != "none" else ""
    return (f"t={run.t}{cp} p={run.p} d={run.d}{ep}, {run.schedule}{limit}{v}, M={run.microbatches}, "
            f"recompute {run.recompute}{sp}{offload}, ZeRO-{run.zero}")


def plan_world(cfg: TrainConfig, launched: int | None) -> int:
    """The ranks ``--plan auto`` plans for: torchrun's ``launched`` world (``plan_ranks`` must agree), else
    ``plan_ranks``, else tp·cp·pp·dp of the flags and defaults."""
    if launched is not None and cfg.plan_ranks and cfg.plan_ranks != launched:
        raise ValueError(f"--plan-ranks {cfg.plan_ranks} but torchrun started {launched} ranks: drop --plan-ranks "
                         "or make them agree")
    check_int("--plan-ranks", cfg.plan_ranks, minimum=0)
    return launched or cfg.plan_ranks or cfg.dims.world_size


def auto_plan(cfg: TrainConfig, world: int, given: Iterable[str] = ()) -> tuple[TrainConfig, LocalPrediction, str]:
    """The planned config for ``world`` ranks, its prediction, and the line that states the plan. ``given``: the
    settings the user gave; those the planner chooses (``PLANNED``) keep their values (pins)."""
    pins = _pins(cfg, given)
    kept = f" with {_flags(cfg, pins)} kept" if pins else ""
    profile = profile_of(cfg)
    if cfg.memory_limit_gb:
        limit = cfg.memory_limit_gb * 1e9
    else:  # a CPU's memory is shared by the ranks on it; a GPU's is each rank's own
        limit = profile.memory_gb * 1e9 / (world if profile.device == "cpu" else 1)
    plan = plan_local(local_run(cfg, profile), world, profile, limit, CAPABILITIES, lambda run: _accepted(cfg, world, run), pins)
    if not plan.ranked:
        if plan.leanest is None:
            raise ValueError(f"--plan auto: no layout the trainer runs splits this model on {world} ranks{kept} "
                             f"(batch {cfg.batch_size}, {cfg.model.layers} layers, {cfg.model.heads} heads)")
        run, pred = plan.leanest
        rank, need = pred.busiest
        raise ValueError(f"--plan auto: no layout fits {limit / 1e9:.3g} GB per rank on {world} ranks{kept}: the leanest "
                         f"({describe(run)}) needs {need / 1e9:.3g} GB on pipeline stage {rank}")
    run, pred = plan.ranked[0]
    mem = pred.memory
    mib = lambda x: f"{x / 2**20:,.1f}"  # noqa: E731
    why = "as given (--schedule)" if "schedule" in pins else why_schedule(plan, run, pred)
    line = (f"plan on {profile.name} ({len(plan.ranked)} of {plan.tried} layouts{kept} fit): {describe(run)}; predicted "
            f"step {1e3 * pred.step_time_s:,.1f} ms, bubble {100 * pred.bubble:.1f}%, rank 0 "
            f"{mib(mem['parameters'])} + {mib(mem['gradients'])} + {mib(mem['optimizer'])} + "
            f"{mib(mem.get('activations', 0.0))} MiB (parameters + gradients + AdamW + activations), "
            f"busiest stage {pred.busiest[0]} {mib(pred.busiest[1])} MiB; schedule {why}")
    experts = why_ep(plan, run, pred)
    line += f"; experts {experts}" if experts else ""
    return _config(cfg, run), pred, line
