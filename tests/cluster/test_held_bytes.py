"""Held activations in bytes, predicted against measured (issue 39): for every schedule the trainer runs, at
p = 2, a tiny float64 model, one step, each rank's peak of what autograd held for backward (``ActivationMeter``
around every action: ``TrainResult.peak_held_bytes``) against the simulator's peak of the schedule the rank
ran, a microbatch of stage s weighing the cost model's ``activation_bytes`` of s
(``prediction.held_activation_bytes``). One c2 run per schedule.

They differ by one thing, checked exactly: the first stage's token ids and the last stage's targets of every
microbatch are views of the batch's one tensor (``torch.tensor_split``), which the meter counts once, whole, while
any microbatch keeps it; the cost model counts each microbatch's share. So measured − predicted is between 0 and
the batch's ids and targets (1 KiB each here, of about 0.5 MB), and equals the walk below that counts them so."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from modelpar.costmodel.local_memory import activation_bytes
from modelpar.model import ModelConfig
from modelpar.schedules.action import Kind
from modelpar.schedules.memory import RELEASES, W_KEEPS
from modelpar.schedules.registry import schedule_entry, schedule_names
from modelpar.training import TrainConfig, train
from modelpar.training.prediction import held_activation_bytes, local_run

TINY = ModelConfig(hidden=32, heads=4, layers=4, seq_len=16)
BASE = TrainConfig(model=TINY, steps=1, batch_size=8, microbatches=4, precision="fp64", warmup=1, eval_every=0,
                   eval_batches=1, tp=1, pp=2, dp=1)
NAMES = [n for n in schedule_names() if n != "naive"]  # naive is one microbatch: not a trainer schedule
BATCH_IDS = BASE.batch_size * TINY.seq_len * 8  # int64 token ids (and as many targets) of the whole batch


def _measured(cfg):
    torch.set_num_threads(1)
    r = train(cfg)
    return dist.get_rank(), r.peak_held_bytes, r.schedule


def _shared_batch_walk(cfg, schedule, rank) -> float:
    """The peak with the batch's ids and targets counted as the meter sees them: whole, once, while held."""
    assert W_KEEPS == 1.0  # a pending W keeps the whole microbatch: it is released by B or W
    run = local_run(cfg)
    last = schedule.num_stages - 1
    share = BATCH_IDS / cfg.microbatches
    held = dict.fromkeys(range(schedule.num_stages), 0)
    peak = 0.0
    for s, kind, _ in schedule.actions[rank]:
        held[s] += 1 if kind is Kind.F else -1 if kind in RELEASES else 0
        ends = sum(BATCH_IDS - held[e] * share for e in {0, last} if held[e])
        peak = max(peak, sum(n * activation_bytes(run, e) for e, n in held.items()) + ends)
    return peak


@pytest.mark.parametrize("name", NAMES)
def test_peak_held_bytes_are_the_predicted(c2, name):
    cfg = dataclasses.replace(BASE, schedule=name, chunks=schedule_entry(name).default_chunks).check(2)
    for rank, measured, schedule in c2.run(_measured, cfg):
        predicted = held_activation_bytes(cfg, schedule)[rank]
        assert 0 <= measured - predicted <= 2 * BATCH_IDS, (rank, measured, predicted)
        assert measured == _shared_batch_walk(cfg, schedule, rank), (rank, measured)
