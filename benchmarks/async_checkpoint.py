"""The step time a checkpoint save steals: no saving, blocking saves and ``--async-checkpoint``, side by side.

`modelpar train`'s default run (no arguments: the default model on 4 local ranks, t=2 p=2) once per variant in one
process, each on fresh local processes: without checkpoints, then saving every step and every ``--every`` steps, as
``save`` does (every rank waits for the write) and with ``--async-checkpoint`` (a copy in host memory, written and
sealed in the background). A step's cost is its measured step time plus the time the save after it held training
(``TrainResult.save_stalls``); the first ``--skip`` steps (warm-up) and the run's final save (always blocking) are
left out. Printed: the median and mean cost per step of each and their ratios to no saving (with an interval, the
mean is the one that counts: it spreads each save's cost and the slowdown of the steps it overlaps over the
interval), the median stall and the median time from a save's start to its COMPLETE marker, and, for the
interval, how much longer the steps after a save are (where the background write runs). ``--repeat`` runs the
whole set that many times, interleaved (the ratios are then over all the repeats' steps): the machine's load drifts.

    python benchmarks/async_checkpoint.py [--steps 40] [--skip 2] [--every 10] [--repeat 1] [--out bench-async]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
from dataclasses import replace
from pathlib import Path

from modelpar.training import TrainConfig, TrainResult
from modelpar.training.start import run_local


def costs(result: TrainResult, skip: int, every: int) -> list[float]:
    """Seconds per step: the step and the periodic save after it, if any (``every`` 0: no saving). A run saves after
    steps every, 2·every, ... before its last, then once more at its end (blocking, left out)."""
    steps = len(result.step_times)
    stalls = [0.0] * steps
    if every:
        periodic = result.save_stalls[:-1]
        if len(periodic) != (steps - 1) // every:
            raise RuntimeError(f"{len(result.save_stalls)} saves in a run of {steps} steps saving every {every}")
        for i, stall in enumerate(periodic):
            stalls[(i + 1) * every - 1] = stall
    return [t + s for t, s in zip(result.step_times, stalls)][skip:]


def after_saves(result: TrainResult, every: int, reach: int = 3) -> list[list[float]]:
    """Seconds of the 1st, 2nd, ... ``reach``-th step after each periodic save (where the background write runs)."""
    saves = range(every, len(result.step_times) - 1, every)  # a save after step k: the next step has index k
    return [[result.step_times[k + i] for k in saves if k + i < len(result.step_times)] for i in range(reach)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out")
    parser.add_argument("--every", type=int, default=10, help="the interval of the second pair of saving variants")
    parser.add_argument("--repeat", type=int, default=1, help="runs of the whole set, interleaved")
    parser.add_argument("--out", default="bench-async", help="where the checkpoints go (removed after)")
    args = parser.parse_args()
    base = replace(TrainConfig(), steps=args.steps, eval_every=0)
    variants = {"no saving": base}
    for every in (1, args.every):
        for how, on in (("blocking save", False), ("--async-checkpoint", True)):
            variants[f"{how} every {every}"] = replace(base, checkpoint_every=every, async_checkpoint=on)
    steps: dict[str, list[float]] = {name: [] for name in variants}
    stalls: dict[str, list[float]] = {name: [] for name in variants}
    writes: dict[str, list[float]] = {name: [] for name in variants}
    later: dict[str, list[list[float]]] = {name: [[], [], []] for name in variants}
    for _ in range(args.repeat):
        for i, (name, cfg) in enumerate(variants.items()):
            if cfg.checkpoint_every:
                where = Path(args.out) / f"ck{i}"
                shutil.rmtree(where, ignore_errors=True)
                cfg = replace(cfg, checkpoint_dir=str(where))
            result = run_local(cfg)
            steps[name] += costs(result, args.skip, cfg.checkpoint_every)
            stalls[name] += result.save_stalls[:-1]
            writes[name] += result.save_writes
            if cfg.checkpoint_every > 1:
                for into, got in zip(later[name], after_saves(result, cfg.checkpoint_every)):
                    into += got
    shutil.rmtree(args.out, ignore_errors=True)
    plain = steps["no saving"]
    print(f"default run ({base.layout()}, {args.steps} steps, first {args.skip} left out, {args.repeat} "
          f"repeat{'s' if args.repeat > 1 else ''}); seconds per step including the save's stall; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'':32} {'median ms':>10} {'mean ms':>10} {'ratio (median)':>15} {'ratio (mean)':>13} {'stall ms':>9} "
          f"{'write ms':>9}")
    for name, cost in steps.items():
        median, mean = statistics.median(cost), statistics.fmean(cost)
        stall = statistics.median(stalls[name]) if stalls[name] else 0.0
        write = statistics.median(writes[name]) if writes[name] else 0.0
        print(f"{name:32} {1e3 * median:10.1f} {1e3 * mean:10.1f} {median / statistics.median(plain):15.3f} "
              f"{mean / statistics.fmean(plain):13.3f} {1e3 * stall:9.1f} {1e3 * write:9.1f}")
    base_ms = 1e3 * statistics.median(plain)
    for name, rows in later.items():
        if rows[0]:
            extra = ", ".join(f"{1e3 * statistics.median(r) - base_ms:+.1f}" for r in rows)
            print(f"{name}: the 1st, 2nd and 3rd step after a save, median ms beside no saving's: {extra}")


if __name__ == "__main__":
    main()
