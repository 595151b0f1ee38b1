"""``modelpar bench pipeline``: run a schedule on K local processes, measured vs simulated.

Starts K processes (gloo) — or, under torchrun, runs as one of its ranks (``--backend nccl`` on
GPUs) — runs the built-in MLP through the schedule for a few steps, then feeds the measured
per-action costs and per-message transfer times to the simulator and prints both side by side,
with the measured timeline drawn as the reference's ASCII chart (§4.1, §4.2).
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from modelpar._validate import check_output_path
from modelpar.schedules.registry import schedule_names

if TYPE_CHECKING:  # the type only: importing it loads torch
    from modelpar.bench.pipeline import MLPBench


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "pipeline",
        help="run a pipeline schedule on K local processes; measured vs simulated step time and bubble",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--schedule", default="1f1b", help=f"one of {{{', '.join(schedule_names())}}} (default 1f1b)")
    parser.add_argument("--ranks", type=int, default=4, help="pipeline ranks K = processes (default 4)")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches M (default 8)")
    parser.add_argument("--chunks", type=int, default=1, help="model chunks v per process, interleaved only (default 1)")
    parser.add_argument("--steps", type=int, default=5, help="measured steps after one warm-up (default 5)")
    parser.add_argument("--width", type=int, default=256, help="MLP feature size (default 256)")
    parser.add_argument("--blocks", type=int, default=2, help="MLP blocks per process (default 2)")
    parser.add_argument("--rows", type=int, default=256, help="batch rows N (default 256)")
    parser.add_argument("--recompute", default="none", help="per-stage recomputation: none, full, sqrt or k (default none)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a stuck rank is an error")
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                        help="under torchrun: process-group backend (auto: nccl with GPUs, stages on each rank's GPU)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON only")
    parser.add_argument("--png", metavar="FILE", help="also draw measured and simulated timelines (.png/.svg)")
    parser.add_argument("--trace", metavar="FILE", help="also write both as a Chrome trace (JSON)")
    parser.set_defaults(func=run)


def _recompute(text: str) -> Any:
    from modelpar.recompute.strategies import parse_strategy

    return parse_strategy(text)


def run(args: argparse.Namespace) -> int:
    from modelpar.bench.pipeline import MLPBench, summarize
    from modelpar.distributed import is_torchrun

    torchrun = is_torchrun()
    backend = None if args.backend == "auto" else args.backend
    cuda = torchrun and (backend == "nccl" or (backend is None and _cuda_available()))
    cfg = MLPBench(schedule=args.schedule, ranks=args.ranks, microbatches=args.microbatches,
                   chunks=args.chunks, width=args.width, blocks=args.blocks, rows=args.rows,
                   steps=args.steps, recompute=_recompute(args.recompute), timeout=args.timeout, cuda=cuda)
    cfg.build_schedule()  # bad schedule arguments fail here, before any process starts
    if args.png:
        check_output_path("--png", args.png, (".png", ".svg"))
    if args.trace:
        check_output_path("--trace", args.trace, (".json",))
    if cfg.recompute != "none":
        from modelpar.recompute.strategies import plan_recompute

        plan_recompute(3 * (cfg.blocks // cfg.chunks), cfg.recompute)

    from modelpar.bench.pipeline import bench_rank
    from modelpar.distributed import launch

    if torchrun:
        result = _under_torchrun(cfg, backend)
        if result is None:
            return 0  # not rank 0: rank 0 prints
    else:
        result = launch(bench_rank, cfg.ranks, cfg, timeout=cfg.timeout, run_timeout=None)[0]
    s = summarize(cfg, result)
    if args.png:
        from modelpar.simulate.plot import plot_timelines

        plot_timelines([s["measured"], s["simulated"]], args.png,
                       title=f"{cfg.schedule}: measured (top) vs simulated with measured costs (bottom), seconds")
    if args.trace:
        from modelpar.simulate.trace import write_trace

        write_trace([s["measured"], s["simulated"]], args.trace, us_per_unit=1e6)
    if args.json:
        keys = ("measured_step_s", "simulated_step_s", "measured_bubble", "simulated_bubble", "wall_step_s",
                "transfer_s", "measured_peak_held", "simulated_peak_held", "in_run_step_s", "in_run_bubble",
                "message_delay_s")
        print(json.dumps({k: s[k] for k in keys}, indent=2))
        return 0
    print(report(cfg, s))
    return 0


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _under_torchrun(cfg: MLPBench, backend: str | None) -> dict[str, Any] | None:
    """Run ``bench_rank`` as one of torchrun's ranks; rank 0's result, None elsewhere."""
    import torch.distributed as dist

    from modelpar.bench.pipeline import bench_rank
    from modelpar.distributed import init_from_env

    init_from_env("nccl" if cfg.cuda else (backend or "gloo"), timeout=cfg.timeout)
    try:
        if dist.get_world_size() != cfg.ranks:
            raise ValueError(f"--ranks ({cfg.ranks}) must equal torchrun's processes ({dist.get_world_size()})")
        return bench_rank(cfg)
    finally:
        dist.destroy_process_group()


def report(cfg: MLPBench, s: dict[str, Any]) -> str:
    """The side-by-side table and the measured chart, as text."""
    from modelpar.simulate.ascii import ascii_chart

    v = f", v = {cfg.chunks}" if cfg.chunks > 1 else ""
    rows = [
        ("", "measured", "simulated"),
        ("step time (ms)", f"{s['measured_step_s'] * 1e3:.2f}", f"{s['simulated_step_s'] * 1e3:.2f}"),
        ("bubble", f"{s['measured_bubble']:.1%}", f"{s['simulated_bubble']:.1%}"),
        ("peak held microbatches", str(s["measured_peak_held"]), str(s["simulated_peak_held"])),
        ("bubble, messages as slow as in this run", "", f"{s['in_run_bubble']:.1%}"),
    ]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    table = "\n".join(f"{r[0]:<{width[0]}}   {r[1]:>{width[1]}}   {r[2]:>{width[2]}}" for r in rows)
    measured = s["measured"]
    unit = measured.step_time / 100
    return (
        f"{cfg.schedule} (K = {cfg.ranks}, M = {cfg.microbatches}{v}) on {cfg.ranks} "
        f"{'NCCL processes (one GPU each)' if cfg.cuda else 'gloo processes'}: "
        f"MLP width {cfg.width}, {cfg.blocks} blocks per process, {cfg.rows} rows, median of {cfg.steps} steps\n"
        f"simulated = the simulator fed this run's mean action times and measured messages "
        f"({s['transfer_s'] * 1e3:.3f} ms one way, latency + bytes / bandwidth); in this run a message kept "
        f"a waiting receiver {s['message_delay_s'] * 1e3:.3f} ms on average (wake-up included)\n\n{table}\n"
        f"(wall-clock step incl. entry and send completion: {s['wall_step_s'] * 1e3:.2f} ms)\n\n"
        f"Measured timeline, one cell = {unit * 1e3:.3f} ms:\n{ascii_chart(measured, unit=unit)}"
    )
