"""Run the built-in MLP through a schedule on real processes, and compare the run with the simulator.

``bench_rank`` runs on every rank (start it with ``LocalCluster`` / ``launch`` or torchrun);
rank 0 returns the measured timelines. ``summarize`` (in the parent) feeds the measured
per-action costs and per-message transfer times (latency + bytes / bandwidth, from a ping-pong
on the same group) back to the simulator (``measure.simulate_measured``) and puts the prediction beside
the measurement. ``modelpar bench pipeline`` and ``benchmarks/`` use both.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from modelpar._validate import check_choice, check_divisible, check_int, check_number
from modelpar.recompute.strategies import Strategy
from modelpar.schedules.registry import get_schedule, schedule_names
from modelpar.schedules.schedule import Schedule
from modelpar.simulate.timeline import Timeline

__all__ = ["MLPBench", "bench_rank", "summarize", "torch_schedule_step"]


@dataclass(frozen=True)
class MLPBench:
    """One measured configuration: schedule, pipeline shape and the built-in MLP's size."""

    schedule: str = "1f1b"  # one of modelpar.schedules.schedule_names()
    ranks: int = 4  # K: pipeline ranks (processes)
    microbatches: int = 8  # M
    chunks: int = 1  # v: model chunks per process (interleaved only)
    width: int = 256  # MLP feature size
    blocks: int = 2  # MLP blocks (width -> 4 width -> width) per process, split over its chunks
    rows: int = 256  # batch rows N
    steps: int = 5  # measured steps (after one warm-up step)
    recompute: Strategy = "none"  # per-stage activation recomputation
    threads: int = 1  # torch intra-op threads per process
    timeout: float = 60.0  # seconds a rank may wait for a peer
    cuda: bool = False  # stages on each rank's GPU (under torchrun with NCCL)

    def __post_init__(self) -> None:
        check_choice("schedule", self.schedule, schedule_names())
        check_int("ranks", self.ranks, minimum=1)
        check_int("microbatches", self.microbatches, minimum=1)
        for name in ("width", "blocks", "steps", "threads"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("rows", self.rows, minimum=self.microbatches)
        check_divisible("blocks", self.blocks, "chunks", check_int("chunks", self.chunks, minimum=1))
        check_number("timeout", self.timeout, 0.0, strict=True)
        if self.timeout > 86400:
            raise ValueError(f"timeout must be <= 86400 seconds, got {self.timeout:g}")

    def build_schedule(self) -> Schedule:
        return get_schedule(self.schedule, ranks=self.ranks, microbatches=self.microbatches, chunks=self.chunks)


def bench_rank(cfg: MLPBench) -> dict[str, Any] | None:
    """Every rank: run warm-up + ``cfg.steps`` steps; rank 0 returns timelines and wall times."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from modelpar.bench.mlp import mlp_model
    from modelpar.pipeline.measure import measured_timeline, transfer_times
    from modelpar.pipeline.runner import PipelineRunner
    from modelpar.pipeline.stages import split_stages

    torch.set_num_threads(cfg.threads)
    schedule = cfg.build_schedule()
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.cuda else torch.device("cpu")
    rank, group = dist.get_rank(), dist.group.WORLD
    per_stage = cfg.blocks // schedule.chunks
    model = mlp_model(cfg.width, per_stage * schedule.num_stages).to(device)
    stages = split_stages(model, schedule, rank, [3 * per_stage] * schedule.num_stages, cfg.recompute)
    runner = PipelineRunner(schedule, stages, F.mse_loss, group, timeout=cfg.timeout)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(cfg.rows, cfg.width, generator=gen).to(device)
    y = torch.randn(cfg.rows, cfg.width, generator=gen).to(device)
    timelines, walls, peaks = [], [], []
    for i in range(1 + cfg.steps):
        dist.barrier()
        start = time.perf_counter()
        runner.step(x, y)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
        for p in runner.parameters():
            p.grad = None
        timeline = measured_timeline(runner)
        if i:
            timelines.append(timeline)
            walls.append(wall)
            peaks.append(runner.record.peak_held)
        if i == 0:
            transfer_in = transfer_times(runner)  # on the same group, between the warm-up and the measured steps
    everyone = gather_per_rank({"walls": walls, "peak": peaks[-1]})
    if rank:
        return None
    return {"timelines": timelines, "walls": [max(w) for w in zip(*(r["walls"] for r in everyone))],
            "transfer_in": transfer_in, "peak_held": [r["peak"] for r in everyone]}


def gather_per_rank(obj: Any) -> list[Any]:
    """Every rank's ``obj`` of the bench (outside the timed steps)."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def summarize(cfg: MLPBench, result: dict[str, Any]) -> dict[str, Any]:
    """Measured (median step) vs simulated with the measured costs: step time, bubble, peaks."""
    from modelpar.pipeline.measure import measured_durations, message_delays, simulate_measured

    timelines: list[Timeline] = result["timelines"]
    order = sorted(range(len(timelines)), key=lambda i: timelines[i].step_time)
    median = timelines[order[len(order) // 2]]
    durations = measured_durations(timelines)
    predicted = simulate_measured(cfg.build_schedule(), durations, result["transfer_in"])
    delays = message_delays(timelines)
    in_run = simulate_measured(cfg.build_schedule(), durations, delays)
    chunks = median.chunks
    crossing = [t for t in result["transfer_in"] if t]
    return {
        "measured_step_s": median.step_time,
        "simulated_step_s": predicted.step_time,
        "measured_bubble": median.bubble,
        "simulated_bubble": predicted.bubble,
        "in_run_step_s": in_run.step_time,
        "in_run_bubble": in_run.bubble,
        "wall_step_s": statistics.median(result["walls"]),
        "transfer_s": statistics.fmean(crossing) if crossing else 0.0,  # one message, mean over boundaries
        "message_delay_s": statistics.fmean([d for d in delays if d]) if any(delays) else 0.0,  # the same, in the run
        "measured_peak_held": result["peak_held"],
        "simulated_peak_held": [round(p * chunks) for p in predicted.peak_held],
        "measured": median,
        "simulated": predicted,
    }


def torch_schedule_step(schedule: Any, first: bool, last: bool, x: Any, y: Any) -> None:
    """One step of a ``torch.distributed.pipelining`` schedule on this rank: the rank holding the first
    stage feeds the inputs, the one holding the last stage the targets (both, when one rank holds both)."""
    if first and last:
        schedule.step(x, target=y)
    elif first:
        schedule.step(x)
    elif last:
        schedule.step(target=y)
    else:
        schedule.step()
