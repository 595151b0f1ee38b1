"""``modelpar plan --validate-local``: short runs on this machine, each beside the cost model's prediction.

Every split (t, p, d) of each process count × schedules × microbatch counts × recomputation × two
model sizes (and ZeRO-1/2/3 where d > 1) runs a few steps in one ``LocalCluster`` per process count
(each rank with the threads ``modelpar train`` gives it); the median step after the first
``SETTLING_STEPS``, the bubble and rank 0's bytes are set against ``training.prediction.predict_run`` on the
given hardware profile. Reported: per configuration, predicted vs measured with the error; the mean
absolute percentage error (MAPE) over the configurations with at most one rank per core and,
separately, the rest; per model and process count, how far the planner's pick (least predicted time)
is from the fastest measured; and the measurement's own noise (its steps' spread, and with
``rounds`` > 1 how far repeated rounds differ), below which no prediction can be judged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from modelpar.costmodel.profiles import HardwareProfile
from modelpar.model import ModelConfig
from modelpar.training.config import TrainConfig

__all__ = ["LocalCase", "cases", "format_report", "repeatability", "spread", "summarise", "validate_local"]

MODELS = {"h64": ModelConfig(hidden=64, heads=4, layers=4, seq_len=64),
          "h128": ModelConfig(hidden=128, heads=4, layers=4, seq_len=64)}
BASE = TrainConfig(steps=12, batch_size=16, eval_every=0, eval_batches=1, warmup=1)  # 16: every d·m here divides it
SETTLING_STEPS = 2  # steps left out of the median: a run's first steps are slower (allocation, first touch)


@dataclass
class LocalCase:
    """One configuration: its name, the config, and (after running) predicted and measured figures."""

    model: str
    cfg: TrainConfig
    shared: bool  # more ranks than cores
    predicted: dict[str, float] = dataclasses.field(default_factory=dict)
    measured: dict[str, float] = dataclasses.field(default_factory=dict)
    round_steps: list[float] = dataclasses.field(default_factory=list)  # each round's median step

    @property
    def name(self) -> str:
        c = self.cfg
        return (f"{self.model} t={c.tp} p={c.pp} d={c.dp}{f' cp={c.cp}' if c.cp > 1 else ''} {c.schedule} "
                f"m={c.microbatches} {c.recompute}" + (f" zero{c.zero}" if c.zero else ""))

    def error(self, key: str = "step_time_s") -> float:
        return self.predicted[key] / self.measured[key] - 1


def _splits(world: int) -> Iterator[tuple[int, int, int]]:
    for t in (x for x in range(1, world + 1) if world % x == 0):
        for p in (x for x in range(1, world // t + 1) if (world // t) % x == 0):
            yield t, p, world // (t * p)


def cases(ranks: list[int], cores: int, full_grid_up_to: int | None = None) -> list[LocalCase]:
    """The configurations: the whole grid for process counts up to ``full_grid_up_to`` (default: the cores),
    with ZeRO-1, 2 and 3 where d > 1 (the larger model, 1F1B, m = 4, no recomputation) and at 2 ranks cp = 2
    (ring, both models, m = 2 and 4), and a smaller one above it (m = 4, no recomputation, the larger model; 1F1B,
    and GPipe where p > 1: the longest fill and drain, whose idle ranks leave their cores to the others)."""
    out = []
    limit = cores if full_grid_up_to is None else full_grid_up_to
    for world in ranks:
        full = world <= limit
        for t, p, d in _splits(world):
            schedules = ["1f1b", "gpipe"] if p > 1 else ["1f1b"]  # GPipe: the longest fill and drain
            for name, model in MODELS.items() if full else [("h128", MODELS["h128"])]:
                for schedule in schedules:
                    for m in ((2, 4) if full else (4,)):
                        for recompute in (("none", "full") if full else ("none",)):
                            cfg = dataclasses.replace(BASE, model=model, tp=t, pp=p, dp=d, schedule=schedule,
                                                      microbatches=m, recompute=recompute)
                            out.append(LocalCase(name, cfg.check(world), world > cores))
            if full and d > 1:  # the ZeRO stages the planner prices, on the larger model
                for zero in (1, 2, 3):
                    cfg = dataclasses.replace(BASE, model=MODELS["h128"], tp=t, pp=p, dp=d, microbatches=4, zero=zero)
                    out.append(LocalCase("h128", cfg.check(world), world > cores))
        if full and world == 2:  # context parallelism over both ranks: the ring, each model, m = 2 and 4
            for name, model in MODELS.items():
                for m in (2, 4):
                    cfg = dataclasses.replace(BASE, model=model, tp=1, pp=1, dp=1, cp=2, microbatches=m)
                    out.append(LocalCase(name, cfg.check(world), world > cores))
    return out


def _run_rank(cfg: TrainConfig) -> tuple[Any, ...]:
    import torch

    from modelpar.training import train
    from modelpar.training.prediction import held_parameter_bytes
    from modelpar.training.start import rank_threads

    torch.set_num_threads(rank_threads(cfg.dims.world_size))
    r = train(cfg)
    return (r.step_times[SETTLING_STEPS:] or r.step_times, r.bubble_measured, held_parameter_bytes(cfg, r),
            r.gradient_bytes, r.optimizer_state_bytes, r.activation_bytes)


def spread(times: list[float]) -> float:
    """The steps' interquartile range over their median: how much one run's own steps vary."""
    if len(times) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4)
    return (q3 - q1) / statistics.median(times)


def validate_local(todo: list[LocalCase], profile: HardwareProfile, progress: Any = None,
                   rounds: int = 1) -> list[LocalCase]:
    """Run every case (one cluster per process count, all started first) ``rounds`` times and fill in predicted and
    measured figures: the step is the median of the rounds' medians (``round_steps``), ``step_spread`` the first
    round's steps' ``spread``. A round goes through every process count in turn (1, 2, 4, then 1, 2, 4 again): a
    VM's speed drifts over minutes, and one process count's cases measured in one stretch moved all its rows one
    way against the other count's (the one-rank rows +24 … +53% in one validation, −3 … −22% in the next)."""
    from modelpar.distributed import LocalCluster
    from modelpar.training.prediction import predict_run

    worlds = sorted({c.cfg.dims.world_size for c in todo})
    for case in todo:
        pred = predict_run(case.cfg, profile)
        case.predicted = {"step_time_s": pred.step_time_s, "bubble": pred.bubble,
                          **{f"{k}_bytes": v for k, v in pred.memory.items()}}
        case.measured, case.round_steps = {}, []
    with contextlib.ExitStack() as stack:
        clusters = {w: stack.enter_context(LocalCluster(w, timeout=300.0, run_timeout=None)) for w in worlds}
        for _ in range(rounds):
            for world in worlds:
                for case in (c for c in todo if c.cfg.dims.world_size == world):
                    _measure(case, clusters[world])
                    if progress is not None:
                        progress(case)
    return todo


def _measure(case: LocalCase, cluster: Any) -> None:
    """One more round of ``case`` on ``cluster``: its median step joins ``round_steps``."""
    times, bubble, params, grads, state, act = cluster.run(_run_rank, case.cfg)[0]
    case.round_steps.append(statistics.median(times))
    first = case.measured.get("step_spread")  # the first round's, computed once
    case.measured = {"step_time_s": statistics.median(case.round_steps),
                     "step_spread": spread(times) if first is None else first,
                     "bubble": bubble if bubble is not None else 0.0,
                     "parameters_bytes": params, "gradients_bytes": grads, "optimizer_bytes": state,
                     "activations_bytes": act or 0.0}


def repeatability(done: list[LocalCase]) -> float | None:
    """The measurement's error against itself: the mean over cases and rounds of |a round's median / the case's
    step − 1| (None with one round). A prediction cannot be judged closer than this."""
    errs = [abs(r / c.measured["step_time_s"] - 1) for c in done if len(c.round_steps) > 1 for r in c.round_steps]
    return sum(errs) / len(errs) if errs else None


def summarise(done: list[LocalCase]) -> dict[str, Any]:
    """MAPE of step time (one rank per core, and shared cores), worst memory error, and the planner's picks."""
    def mape(rows: list[LocalCase]) -> float | None:
        return sum(abs(c.error()) for c in rows) / len(rows) if rows else None

    picks = []
    for key in sorted({(c.model, c.cfg.dims.world_size) for c in done}):
        group = [c for c in done if (c.model, c.cfg.dims.world_size) == key]
        pick = min(group, key=lambda c: c.predicted["step_time_s"])
        fastest = min(group, key=lambda c: c.measured["step_time_s"])
        picks.append({"model": key[0], "ranks": key[1], "pick": pick.name, "fastest": fastest.name,
                      "pick_over_fastest": pick.measured["step_time_s"] / fastest.measured["step_time_s"] - 1})
    memory = [abs(c.error(k)) for c in done for k in ("parameters_bytes", "gradients_bytes", "optimizer_bytes",
                                                     "activations_bytes") if c.measured.get(k)]
    spreads = [c.measured["step_spread"] for c in done if "step_spread" in c.measured]
    return {"configurations": len(done), "one_rank_per_core": sum(not c.shared for c in done),
            "step_mape": mape([c for c in done if not c.shared]), "step_mape_shared": mape([c for c in done if c.shared]),
            "worst_memory_error": max(memory, default=0.0), "picks": picks,
            "step_spread": statistics.median(spreads) if spreads else None,
            "repeatability": repeatability([c for c in done if not c.shared])}


def format_report(done: list[LocalCase], profile: HardwareProfile) -> str:
    """The table and the summary lines ``modelpar plan --validate-local`` prints."""
    lines = [f"predicted on {profile.name} ({profile.device}, {'measured' if profile.torch else 'nominal'}) vs "
             f"measured on this machine ({os.cpu_count()} cores)",
             f"{'configuration':<44} {'predicted':>10} {'measured':>10} {'error':>7}  {'bubble p/m':>11}  "
             f"{'memory p/m (MiB)':>17}"]
    for c in done:
        mem_p = sum(v for k, v in c.predicted.items() if k.endswith("_bytes")) / 2**20
        mem_m = sum(v for k, v in c.measured.items() if k.endswith("_bytes")) / 2**20
        lines.append(f"{c.name + (' *' if c.shared else ''):<44} {1e3 * c.predicted['step_time_s']:>8.1f}ms "
                     f"{1e3 * c.measured['step_time_s']:>8.1f}ms {100 * c.error():>+6.1f}%  "
                     f"{100 * c.predicted['bubble']:>4.0f}%/{100 * c.measured['bubble']:>3.0f}%  "
                     f"{mem_p:>8.2f}/{mem_m:<8.2f}")
    s = summarise(done)
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    lines.append(f"step-time MAPE: {pct(s['step_mape'])} over {s['one_rank_per_core']} configurations with at most one "
                 f"rank per core; {pct(s['step_mape_shared'])} over the {s['configurations'] - s['one_rank_per_core']} "
                 "with shared cores (*)")
    lines.append(f"the measurement itself: a run's steps spread {pct(s['step_spread'])} (interquartile range / "
                 "median, the median over configurations); " + (
                     f"its rounds {pct(s['repeatability'])} from their median (the error a perfect prediction would "
                     "show here)" if s["repeatability"] is not None else "--rounds 2 measures its repeatability"))
    lines.append(f"memory: worst error {pct(s['worst_memory_error'])} (parameters, gradients and AdamW exact; "
                 "activations counted)")
    for p in s["picks"]:
        lines.append(f"planner's pick for {p['model']} on {p['ranks']} rank(s): {p['pick']}, "
                     f"{pct(p['pick_over_fastest'])} slower than the fastest measured ({p['fastest']})")
    return "\n".join(lines)
