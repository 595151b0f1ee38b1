"""``modelpar train --plan auto``: the planner picks the layout the trainer runs, before any process starts.

The candidates are ``costmodel.local_search``'s, restricted to what the trainer runs and the local
cost model prices: the trainer's schedule list, its ZeRO stages that ``costmodel.local`` prices
(``PRICED_ZERO``: 0–3, ZeRO-2/3's per-microbatch collectives included), context parallelism
(cp over the divisors of the world, ring and all-gather, where ``check_trainer_context`` allows), and
``TrainConfig.check`` must accept each one. Each is
priced on the run's hardware profile (``--hardware``, else the nominal CPU); the fastest whose
most loaded rank fits ``memory_limit_gb`` (default: the device's memory, a CPU host's shared by
its ranks) is run. None fitting is a one-line ValueError naming the stage and the bytes.
"""

from __future__ import annotations

from dataclasses import replace

from modelpar.costmodel.local import PRICED_ZERO, LocalPrediction
from modelpar.costmodel.local_memory import LocalRun
from modelpar.costmodel.local_search import Capabilities, plan_local, why_ep, why_schedule
from modelpar.training.config import SCHEDULE_CHOICES, ZERO_CHOICES, TrainConfig
from modelpar.training.prediction import local_run, profile_of

__all__ = ["CAPABILITIES", "auto_plan", "describe"]

CAPABILITIES = Capabilities(schedules=(*SCHEDULE_CHOICES, "auto"),
                            zero=tuple(z for z in ZERO_CHOICES if z in PRICED_ZERO))


def _config(cfg: TrainConfig, run: LocalRun) -> TrainConfig:
    return replace(cfg, tp=run.t, pp=run.p, dp=run.d, cp=run.cp, cp_comm=run.cp_comm, schedule=run.schedule,
                   chunks=run.v, microbatches=run.microbatches, recompute=run.recompute,
                   sequence_parallel=run.sequence_parallel, zero=run.zero, memory_limit=run.memory_limit, ep=run.ep)


def _accepted(cfg: TrainConfig, world: int, run: LocalRun) -> bool:
    try:
        _config(cfg, run).check(world)
    except ValueError:
        return False
    return True


def describe(run: LocalRun) -> str:
    sp = ", sequence parallel" if run.sequence_parallel else ""
    limit = f" (memory limit {run.memory_limit:.3g})" if run.schedule == "auto" else ""
    v = f", v={run.v}" if run.v > 1 else ""
    cp = f" cp={run.cp} ({run.cp_comm})" if run.cp > 1 else ""
    ep = f" ep={run.ep}" if run.ep > 1 else ""
    return (f"t={run.t}{cp} p={run.p} d={run.d}{ep}, {run.schedule}{limit}{v}, M={run.microbatches}, "
            f"recompute {run.recompute}{sp}, ZeRO-{run.zero}")


def auto_plan(cfg: TrainConfig, world: int) -> tuple[TrainConfig, LocalPrediction, str]:
    """The planned config for ``world`` ranks, its prediction, and the line that states the plan."""
    profile = profile_of(cfg)
    if cfg.memory_limit_gb:
        limit = cfg.memory_limit_gb * 1e9
    else:  # a CPU's memory is shared by the ranks on it; a GPU's is each rank's own
        limit = profile.memory_gb * 1e9 / (world if profile.device == "cpu" else 1)
    plan = plan_local(local_run(cfg), world, profile, limit, CAPABILITIES, lambda run: _accepted(cfg, world, run))
    if not plan.ranked:
        if plan.leanest is None:
            raise ValueError(f"--plan auto: no layout the trainer runs splits this model on {world} ranks "
                             f"(batch {cfg.batch_size}, {cfg.model.layers} layers, {cfg.model.heads} heads)")
        run, pred = plan.leanest
        rank, need = pred.busiest
        raise ValueError(f"--plan auto: no layout fits {limit / 1e9:.3g} GB per rank on {world} ranks: the leanest "
                         f"({describe(run)}) needs {need / 1e9:.3g} GB on pipeline stage {rank}")
    run, pred = plan.ranked[0]
    mem = pred.memory
    mib = lambda x: f"{x / 2**20:,.1f}"  # noqa: E731
    line = (f"plan on {profile.name} ({len(plan.ranked)} of {plan.tried} layouts fit): {describe(run)}; predicted "
            f"step {1e3 * pred.step_time_s:,.1f} ms, bubble {100 * pred.bubble:.1f}%, rank 0 "
            f"{mib(mem['parameters'])} + {mib(mem['gradients'])} + {mib(mem['optimizer'])} + "
            f"{mib(mem.get('activations', 0.0))} MiB (parameters + gradients + AdamW + activations), "
            f"busiest stage {pred.busiest[0]} {mib(pred.busiest[1])} MiB; schedule {why_schedule(plan, run, pred)}")
    experts = why_ep(plan, run, pred)
    line += f"; experts {experts}" if experts else ""
    return _config(cfg, run), pred, line
