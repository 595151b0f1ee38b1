"""Our multi-process runtime vs torch.distributed.pipelining, side by side in one run (gloo, CPU).

For each schedule, the same MLP (same seed), batch and microbatches run through
``modelpar.pipeline.PipelineRunner`` and through torch's own schedule class; steps alternate
between the two so that machine noise hits both alike. Printed per schedule: median step time
of each and the ratio ours / torch (aim ≤ 1.0), the largest gradient difference between the two
(float32 here; the float64 transparency tests are in tests/), and our measured bubble beside the
simulator's prediction from the measured action costs.

    python benchmarks/bench_pipeline.py [--ranks 4] [--microbatches 8] [--steps 10] [--only zb-v,dualpipe-v]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from modelpar.bench import mlp_model
from modelpar.bench.pipeline import MLPBench, summarize, torch_schedule_step
from modelpar.distributed import LocalCluster
from modelpar.pipeline import PipelineRunner, measured_timeline, split_stages, transfer_times

# (our schedule name, chunks, torch's class name)
CASES = [
    ("gpipe", 1, "ScheduleGPipe"),
    ("1f1b", 1, "Schedule1F1B"),
    ("interleaved", 2, "ScheduleInterleaved1F1B"),
    ("zb-h1", 1, "ScheduleInterleavedZeroBubble"),
    ("looped-bfs", 2, "ScheduleLoopedBFS"),
    ("zb-v", 2, "ScheduleZBVZeroBubble"),  # V placement: device d holds stages d and 2K - 1 - d
    ("dualpipe-v", 2, "ScheduleDualPipeV"),  # needs M >= 2K
]
_MULTI = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS", "ScheduleZBVZeroBubble",
          "ScheduleDualPipeV")  # torch classes that take a list of stages


def _torch_schedule(cls_name: str, modules: dict, num_stages: int, m: int):
    from torch.distributed import pipelining

    stages = [pipelining.PipelineStage(mod, s, num_stages, torch.device("cpu")) for s, mod in sorted(modules.items())]
    cls = getattr(pipelining, cls_name)
    return cls(stages if cls_name in _MULTI else stages[0], m, loss_fn=F.mse_loss), stages


def compare_rank(cfg: MLPBench, torch_cls: str) -> dict | None:
    """Every rank: alternate our step and torch's on identical copies of the same stages."""
    torch.set_num_threads(1)
    schedule = cfg.build_schedule()
    rank, s_count = dist.get_rank(), schedule.num_stages
    per_stage = cfg.blocks // schedule.chunks
    balance = [3 * per_stage] * s_count
    ours = split_stages(mlp_model(cfg.width, per_stage * s_count), schedule, rank, balance)
    theirs = split_stages(mlp_model(cfg.width, per_stage * s_count), schedule, rank, balance)
    runner = PipelineRunner(schedule, ours, F.mse_loss, dist.group.WORLD, timeout=cfg.timeout)
    tsched, _ = _torch_schedule(torch_cls, theirs, s_count, cfg.microbatches)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(cfg.rows, cfg.width, generator=gen), torch.randn(cfg.rows, cfg.width, generator=gen)
    first, last = rank == schedule.rank_of(0), rank == schedule.rank_of(s_count - 1)

    def torch_step() -> None:
        torch_schedule_step(tsched, first, last, x, y)

    times: dict[str, list[float]] = {"ours": [], "torch": []}
    timelines, grad_diff = [], 0.0
    for i in range(cfg.steps + 1):
        for name, fn in (("ours", lambda: runner.step(x, y)), ("torch", torch_step)):
            dist.barrier()
            start = time.perf_counter()
            fn()
            t = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if i:
                times[name].append(t.item())
        if i == 0:  # both hold one step's gradients: compare them, then drop them
            for s in ours:
                for p, q in zip(ours[s].parameters(), theirs[s].parameters()):
                    grad_diff = max(grad_diff, (p.grad - q.grad).abs().max().item())
            transfer_in = transfer_times(runner)
        tl = measured_timeline(runner)
        if i:
            timelines.append(tl)
        for mod in (*ours.values(), *theirs.values()):
            mod.zero_grad(set_to_none=True)
    diff = torch.tensor([grad_diff])
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    peaks = [0] * dist.get_world_size()
    dist.all_gather_object(peaks, runner.record.peak_held)
    if rank:
        return None
    return {"times": times, "grad_diff": diff.item(), "timelines": timelines, "walls": times["ours"],
            "transfer_in": transfer_in, "peak_held": peaks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--only", default="", help="comma-separated schedule names to run (default: all)")
    args = parser.parse_args()
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = sorted(set(only) - {name for name, _, _ in CASES})
    if unknown:
        parser.error(f"--only must name schedules among {', '.join(name for name, _, _ in CASES)}, got {unknown}")
    print(f"K = {args.ranks}, M = {args.microbatches}, MLP width {args.width}, 2 blocks per process, "
          f"{args.rows} rows, float32, gloo, median of {args.steps} alternating steps\n")
    header = ("schedule", "torch class", "ours ms", "torch ms", "ours/torch", "max |grad diff|",
              "bubble measured", "bubble simulated")
    rows = [header]
    with LocalCluster(args.ranks, timeout=300) as cluster:
        for name, v, cls in CASES:
            if (only and name not in only) or (name == "dualpipe-v" and args.microbatches < 2 * args.ranks):
                continue
            cfg = MLPBench(schedule=name, ranks=args.ranks, microbatches=args.microbatches, chunks=v,
                           width=args.width, blocks=2, rows=args.rows, steps=args.steps)
            res = cluster.run(compare_rank, cfg, cls)[0]
            ours, theirs = statistics.median(res["times"]["ours"]), statistics.median(res["times"]["torch"])
            s = summarize(cfg, res)
            rows.append((name + (f" (v={v})" if v > 1 else ""), cls, f"{ours * 1e3:.2f}", f"{theirs * 1e3:.2f}",
                         f"{ours / theirs:.2f}", f"{res['grad_diff']:.1e}", f"{s['measured_bubble']:.1%}",
                         f"{s['simulated_bubble']:.1%}"))
            print("  ".join(rows[-1]), file=sys.stderr, flush=True)  # progress; the table goes to stdout
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    print()
    for r in rows:
        print("  ".join(f"{c:>{w}}" for c, w in zip(r, widths)))


if __name__ == "__main__":
    main()
