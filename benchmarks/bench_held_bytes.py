"""Peak held activation bytes per rank, predicted and measured, for every schedule the trainer runs (issue 39):
the table in docs/schedules.md ("Held memory in bytes").

p = 2 local gloo ranks, a tiny float64 GPT (h = 32, 4 layers, s = 16), batch 8 in 4 microbatches, one step.
Predicted: the simulator's peak of the schedule the rank ran, a microbatch of stage s weighing the cost model's
``activation_bytes`` of s, the batch's ids and targets (views of one tensor) whole while any microbatch keeps them
(``training.prediction.held_activation_bytes``). Measured: the most bytes autograd held
for backward at once in the step (``TrainResult.peak_held_bytes``). Deterministic: no timings.

    python benchmarks/bench_held_bytes.py
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from modelpar.distributed import LocalCluster
from modelpar.model import ModelConfig
from modelpar.schedules.registry import schedule_entry, schedule_names
from modelpar.training import TrainConfig, train
from modelpar.training.prediction import held_activation_bytes

TINY = ModelConfig(hidden=32, heads=4, layers=4, seq_len=16)
BASE = TrainConfig(model=TINY, steps=1, batch_size=8, microbatches=4, precision="fp64", warmup=1, eval_every=0,
                   eval_batches=1, tp=1, pp=2, dp=1)


def _rank(cfg: TrainConfig) -> tuple[int, Any, Any]:
    torch.set_num_threads(1)
    r = train(cfg)
    return dist.get_rank(), r.peak_held_bytes, r.schedule


def main() -> None:
    print("| schedule | rank | predicted | measured | measured − predicted |")
    print("|---|---|---|---|---|")
    with LocalCluster(2, timeout=600) as cluster:
        for name in schedule_names():
            if name == "naive":  # one microbatch: not a trainer schedule
                continue
            cfg = dataclasses.replace(BASE, schedule=name, chunks=schedule_entry(name).default_chunks).check(2)
            for rank, measured, schedule in cluster.run(_rank, cfg):
                predicted = held_activation_bytes(cfg, schedule)[rank]
                print(f"| {name} | {rank} | {predicted:.0f} | {measured} | {measured - predicted:.0f} |", flush=True)


if __name__ == "__main__":
    main()
