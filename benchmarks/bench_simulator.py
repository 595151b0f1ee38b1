"""Simulator speed: ours vs torch.distributed.pipelining's dry run, and the 1 s budget of issue 2.

1. Side by side on the same schedules (our generators, converted to torch's ``_Action``s): our
   ``simulate`` (validation + timing + metrics, one linear pass) vs torch's dry run
   (``_add_send_recv`` + ``_simulate_comms_compute``, which also finds deadlocks). Ratio = torch / ours.
2. Interleaved K = 64, M = 1024, v = 4 (524,288 actions): generation, and simulate + validate +
   metrics, against the issue's 1 s budget; per-action cost for the other schedules (linearity).

    python benchmarks/bench_simulator.py [--repeats 3]

Best of ``--repeats`` runs (least disturbed by the other jobs on the shared cores).
"""

from __future__ import annotations

import argparse
import time

from modelpar.schedules import get_schedule
from modelpar.simulate import simulate


def timed(fn, repeats: int, clock=time.perf_counter) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = clock()
        out = fn()
        times.append(clock() - start)
    return min(times), out


def torch_dry_run(schedule) -> int:
    """Torch's own dry run of the same action lists; returns its number of simulated steps."""
    from torch.distributed.pipelining import schedules as ts

    kinds = {"F": ts.FORWARD, "B": ts.FULL_BACKWARD, "I": ts.BACKWARD_INPUT, "W": ts.BACKWARD_WEIGHT}
    order = {d: [ts._Action(a.stage, kinds[a.kind.value], a.microbatch) for a in acts]
             for d, acts in enumerate(schedule.actions)}
    stage_to_rank = schedule.stage_to_rank.__getitem__
    with_comms = ts._add_send_recv(order, stage_to_rank, schedule.num_stages)
    steps = ts._simulate_comms_compute(with_comms, stage_to_rank, schedule.num_stages)
    return max(len(v) for v in steps.values())


def full_pass(schedule):
    t = simulate(schedule)
    t.metrics()
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch.distributed.pipelining.schedules  # noqa: F401  (import once, outside the timings)

    print("1. ours (simulate: validate + time + metrics) vs torch dry run (_add_send_recv + _simulate_comms_compute)")
    print(f"{'schedule':<12}{'K':>4}{'M':>6}{'v':>3}{'actions':>9}{'ours s':>10}{'torch s':>10}{'torch/ours':>12}")
    for name, k, m, v in [("1f1b", 4, 32, 1), ("interleaved", 8, 32, 2), ("zb-h1", 8, 64, 1),
                          ("interleaved", 16, 64, 2)]:
        s = get_schedule(name, ranks=k, microbatches=m, chunks=v)
        n = sum(map(len, s.actions))
        ours, _ = timed(lambda: full_pass(s), args.repeats)
        theirs, _ = timed(lambda: torch_dry_run(s), 1)
        print(f"{name:<12}{k:>4}{m:>6}{v:>3}{n:>9}{ours:>10.4f}{theirs:>10.3f}{theirs / ours:>11.0f}x")

    print("\n2. large schedules against the 1 s budget (issue 2)")
    print("   (wall = elapsed; cpu = this process's CPU time, less sensitive to the shared cores)")
    print(f"{'schedule':<12}{'K':>4}{'M':>6}{'v':>3}{'actions':>9}{'generate s':>12}{'simulate s':>12}"
          f"{'cpu s':>8}{'us/action':>11}{'budget/ours':>13}")
    for name, k, m, v in [("interleaved", 64, 1024, 4), ("1f1b", 64, 1024, 1), ("gpipe", 64, 1024, 1),
                          ("zb-h1", 64, 1024, 1)]:
        gen, s = timed(lambda: get_schedule(name, ranks=k, microbatches=m, chunks=v), 1)
        n = sum(map(len, s.actions))
        sim, t = timed(lambda: full_pass(s), args.repeats)
        cpu, _ = timed(lambda: full_pass(s), args.repeats, time.process_time)
        print(f"{name:<12}{k:>4}{m:>6}{v:>3}{n:>9}{gen:>12.3f}{sim:>12.3f}{cpu:>8.3f}{1e6 * cpu / n:>11.2f}"
              f"{1.0 / sim:>12.1f}x")
        assert t.step_time > 0


if __name__ == "__main__":
    main()
