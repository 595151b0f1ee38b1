"""Held activations in bytes, predicted against measured (issue 39): for every schedule the trainer runs, at
p = 2, a tiny float64 model, one step, each rank's peak of what autograd held for backward (``ActivationMeter``
around every action: ``TrainResult.peak_held_bytes``) EQUALS the simulator's peak of the schedule the rank ran,
a microbatch of stage s weighing the cost model's ``activation_bytes`` of s, the batch's ids and targets (the
microbatches' views of one tensor) counted whole while any microbatch keeps them
(``prediction.held_activation_bytes``). One c2 run per schedule."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from modelpar.model import ModelConfig
from modelpar.schedules.registry import schedule_entry, schedule_names
from modelpar.training import TrainConfig, train
from modelpar.training.prediction import held_activation_bytes

TINY = ModelConfig(hidden=32, heads=4, layers=4, seq_len=16)
BASE = TrainConfig(model=TINY, steps=1, batch_size=8, microbatches=4, precision="fp64", warmup=1, eval_every=0,
                   eval_batches=1, tp=1, pp=2, dp=1)
NAMES = [n for n in schedule_names() if n != "naive"]  # naive is one microbatch: not a trainer schedule


def _measured(cfg):
    torch.set_num_threads(1)
    r = train(cfg)
    return dist.get_rank(), r.peak_held_bytes, r.schedule


@pytest.mark.parametrize("name", NAMES)
def test_peak_held_bytes_are_the_predicted(c2, name):
    cfg = dataclasses.replace(BASE, schedule=name, chunks=schedule_entry(name).default_chunks).check(2)
    for rank, measured, schedule in c2.run(_measured, cfg):
        assert measured == held_activation_bytes(cfg, schedule)[rank], (name, rank)


@pytest.mark.parametrize("changes", [dict(pp=1, dp=2), dict(pp=1, dp=2, precision="bf16", model=dataclasses.replace(
    TINY, arch="llama", kv_heads=2))], ids=["dp2", "dp2-bf16-llama"])
def test_a_replica_holds_its_own_rows_of_the_batch(c2, changes):
    """At d = 2 each replica keeps its own half of the batch (a copy, not a view that keeps the whole global batch
    alive), so its held bytes are the predicted ones too; bf16 with Llama's widths and autocast's weight copies."""
    cfg = dataclasses.replace(BASE, schedule="1f1b", **changes).check(2)
    for rank, measured, schedule in c2.run(_measured, cfg):
        assert measured == held_activation_bytes(cfg, schedule)[0], rank  # one pipeline rank: both replicas its
