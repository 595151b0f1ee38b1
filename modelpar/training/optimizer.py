"""The run's AdamW: torch's on whole parameters (ZeRO-0), or ``ZeroAdamW`` on this rank's ranges (ZeRO-1-3).

Both are plain ``torch.optim.AdamW`` underneath (fused on GPUs), with betas (0.9, 0.95), eps 1e-8
and decoupled weight decay on matrices only; the state is created before the first step
(``init_optimizer_state``) so that a checkpoint can be loaded into it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from modelpar.training.dp_comm import DataParallelComm
from modelpar.training.grads import GradSync
from modelpar.training.zero import ZeroAdamW

__all__ = ["Optimizer", "build_optimizer", "measured_state_bytes", "param_groups", "set_lr"]

Optimizer = torch.optim.Optimizer | ZeroAdamW


def param_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on matrices (embeddings too), none on biases and norms (nanoGPT's rule)."""
    params = list(params)
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def build_optimizer(zero: int, sync: GradSync, comm: DataParallelComm, dp_rank: int, lr: float,
                    weight_decay: float) -> Optimizer:
    """AdamW over ``sync``'s parameters (``zero`` 0) or over this rank's ranges of its buckets (``zero`` 1-3)."""
    device = sync.params[0].device
    kwargs: dict[str, Any] = {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8}
    if device.type == "cuda":
        kwargs["fused"] = True
    if zero:
        return ZeroAdamW(sync.buckets, comm, dp_rank, weight_decay, gather=zero < 3, shard_of=sync.shard_of, **kwargs)
    return torch.optim.AdamW(param_groups(sync.params, weight_decay), **kwargs)


def measured_state_bytes(optimizer: Optimizer) -> int:
    """Bytes of the AdamW state tensors this rank holds (the moments; the 0-d step counts aside), counted
    from the tensors; ``modelpar.costmodel.zero_bytes.optimizer_state_bytes`` is the prediction."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for key, v in state.items() if key != "step")


def set_lr(optimizer: Optimizer, lr: float) -> None:
    """This step's learning rate in every parameter group (``loop.lr_at``'s schedule)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
