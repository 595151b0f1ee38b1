"""What a tensor-parallel all-reduce costs inside the trainer: ``--validate-local``'s t = 2 runs with every
``dist.all_reduce`` of ``tensor_parallel._comm`` timed, beside the profile's busy all-reduce at that size.

    modelpar calibrate --out hw.json --ranks 1,2
    python benchmarks/tp_all_reduce_in_step.py hw.json

On a 2-core VM (2026-12-02) one took 1.31-1.65 ms on average in the step; the busy pattern priced
1.3-2.0 ms (docs/calibrate.md). Timing only: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any


def _rank(cfg: Any) -> tuple[float, int, float, int]:
    """(median step, tp all-reduces, seconds in them, steps) of one rank training ``cfg``."""
    import torch

    import modelpar.tensor_parallel._comm as comm
    from modelpar.calibrate.validate_local import SETTLING_STEPS
    from modelpar.training import train
    from modelpar.training.start import rank_threads

    torch.set_num_threads(rank_threads(cfg.dims.world_size))
    spent = {"calls": 0, "seconds": 0.0}
    plain = comm.dist.all_reduce

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = plain(*args, **kwargs)
        spent["seconds"] += time.perf_counter() - t0
        spent["calls"] += 1
        return out

    comm.dist.all_reduce = timed  # type: ignore[assignment]
    try:
        result = train(cfg)
    finally:
        comm.dist.all_reduce = plain  # type: ignore[assignment]
    steps = len(result.step_times)
    return statistics.median(result.step_times[SETTLING_STEPS:]), int(spent["calls"]), spent["seconds"], steps


def main() -> None:
    from modelpar.calibrate.validate_local import BASE, MODELS
    from modelpar.costmodel.profiles import load_profile
    from modelpar.distributed import LocalCluster
    from modelpar.formulas import allreduce_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    args = parser.parse_args()
    busy = load_profile(args.profile).busy_cost("all_reduce", 2)
    with LocalCluster(2, timeout=300.0, run_timeout=None) as cluster:
        for name, model in MODELS.items():
            for m in (2, 4):
                cfg = dataclasses.replace(BASE, model=model, microbatches=m, tp=2, pp=1, dp=1).check(2)
                sent = allreduce_bytes(BASE.batch_size // m * model.seq_len * model.hidden * 4, 2)
                priced = f"{1e3 * busy.time(sent):.2f} ms" if busy is not None else "-"
                for rank, (step, calls, seconds, steps) in enumerate(cluster.run(_rank, cfg)):
                    print(f"{name} m={m} rank {rank}: step {1e3 * step:.1f} ms; {calls / steps:.0f} tp all-reduces "
                          f"per step, {1e3 * seconds / calls:.2f} ms each (the profile's busy all-reduce: {priced})")


if __name__ == "__main__":
    main()
