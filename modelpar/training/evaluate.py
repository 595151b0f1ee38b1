"""Validation loss through the pipeline: forward only, the whole batch at once, stage after stage.

No schedule is needed without a backward: each rank runs its (virtual) stages in model order,
receiving the activation from the device of the previous stage and sending to the next one's
(blocking send/recv; a chain, so it cannot deadlock). Tensor-parallel peers do the same in step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from modelpar.model import GPTLoss
from modelpar.pipeline.p2p import comm_device
from modelpar.schedules.schedule import Schedule

__all__ = ["evaluate"]


@torch.no_grad()
def evaluate(modules: Mapping[int, nn.Module], schedule: Schedule, rs: Any, inputs: torch.Tensor | None,
             targets: torch.Tensor | None, act_shape: tuple[int, ...], dtype: torch.dtype) -> float | None:
    """Mean loss of this replica's batch on the last stage's rank; None on the other ranks.

    ``act_shape``: the activation between stages, [b, s, h] ([b, s/t, h] with sequence parallelism).
    The batch goes through in the schedule's micro-batches (equal sizes), so evaluation holds no
    more activations than a training step.
    """
    m = schedule.num_microbatches
    rows = act_shape[0] // m
    xs = inputs.split(rows) if inputs is not None else [None] * m
    ys = targets.split(rows) if targets is not None else [None] * m
    losses = [_forward(modules, schedule, rs, x, y, (rows, *act_shape[1:]), dtype) for x, y in zip(xs, ys)]
    return None if losses[0] is None else sum(losses) / m  # type: ignore[arg-type]


def _forward(modules: Mapping[int, nn.Module], schedule: Schedule, rs: Any, inputs: torch.Tensor | None,
             targets: torch.Tensor | None, act_shape: tuple[int, ...], dtype: torch.dtype) -> float | None:
    """One micro-batch through every stage in model order; its mean loss on the last stage's rank."""
    ranks = dist.get_process_group_ranks(rs.pp_group)
    comm = comm_device(rs.pp_group)  # the CPU when the pipeline group is gloo (also under NCCL)
    dev, last = schedule.stage_to_device, schedule.num_stages - 1
    modes = [(m, m.training) for m in modules.values()]
    for m, _ in modes:
        m.eval()
    try:
        x = inputs.to(rs.device) if inputs is not None else None
        for s in schedule.stages_on(rs.pp_rank):
            if s > 0 and dev[s - 1] != rs.pp_rank:
                x = torch.empty(act_shape, dtype=dtype, device=comm)
                dist.recv(x, src=ranks[dev[s - 1]], group=rs.pp_group)
                x = x.to(rs.device)
            x = modules[s](x)
            if s < last and dev[s + 1] != rs.pp_rank:
                dist.send(x.to(comm).contiguous(), dst=ranks[dev[s + 1]], group=rs.pp_group)
        if dev[last] != rs.pp_rank:
            return None
        assert targets is not None and x is not None
        return float(GPTLoss(rs.tp_group)(x, targets.to(rs.device)))
    finally:
        for m, training in modes:
            m.train(training)
