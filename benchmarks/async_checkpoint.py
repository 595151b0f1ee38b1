"""The step time a checkpoint save steals: no saving, blocking saves and ``--async-checkpoint``, side by side.

`modelpar train`'s default run (no arguments: the default model on 4 local ranks, t=2 p=2) three times in one
process, each on fresh local processes: without checkpoints, saving every step as ``save`` does (every rank waits
for the write), and saving every step with ``--async-checkpoint`` (a copy in host memory, written in the
background). A step's cost is its measured step time plus the time the save after it held training
(``TrainResult.save_stalls``); the first ``--skip`` steps (warm-up) and the run's final save (always blocking) are
left out. Printed: the median and mean cost per step of each, and the ratios to no saving.

    python benchmarks/async_checkpoint.py [--steps 20] [--skip 2] [--out bench-async]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
from dataclasses import replace
from pathlib import Path

from modelpar.training import TrainConfig, TrainResult
from modelpar.training.start import run_local


def costs(result: TrainResult, skip: int, saving: bool) -> list[float]:
    """Seconds per step: the step and the save after it (the final, blocking save left out)."""
    stalls = result.save_stalls[:-1] if saving else [0.0] * len(result.step_times)
    return [t + s for t, s in zip(result.step_times, stalls)][skip:len(stalls)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out")
    parser.add_argument("--out", default="bench-async", help="where the checkpoints go (removed after)")
    args = parser.parse_args()
    base = replace(TrainConfig(), steps=args.steps, eval_every=0)
    variants = {"no saving": base,
                "blocking save every step": replace(base, checkpoint_every=1, async_checkpoint=False),
                "--async-checkpoint every step": replace(base, checkpoint_every=1, async_checkpoint=True)}
    rows = {}
    for i, (name, cfg) in enumerate(variants.items()):
        saving = cfg.checkpoint_every > 0
        if saving:
            where = Path(args.out) / f"ck{i}"
            shutil.rmtree(where, ignore_errors=True)
            cfg = replace(cfg, checkpoint_dir=str(where))
        result = run_local(cfg)
        step = costs(result, args.skip, saving)
        rows[name] = (statistics.median(step), statistics.fmean(step),
                      statistics.median(result.save_stalls[:-1]) if saving else 0.0,
                      statistics.median(result.save_writes) if saving else 0.0)
    shutil.rmtree(args.out, ignore_errors=True)
    plain = rows["no saving"]
    print(f"default run ({base.layout()}, {args.steps} steps, first {args.skip} left out); seconds per step "
          "including the save's stall")
    print(f"{'':32} {'median ms':>10} {'mean ms':>10} {'ratio (median)':>15} {'ratio (mean)':>13} {'stall ms':>9} "
          f"{'write ms':>9}")
    for name, (median, mean, stall, write) in rows.items():
        print(f"{name:32} {1e3 * median:10.1f} {1e3 * mean:10.1f} {median / plain[0]:15.3f} {mean / plain[1]:13.3f} "
              f"{1e3 * stall:9.1f} {1e3 * write:9.1f}")


if __name__ == "__main__":
    main()
