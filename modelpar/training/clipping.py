"""Gradient clipping by the global L2 norm, over the gradients ``GradSync`` reduced (step 4 of its order).

The norm is over all shards: each distinct tensor-parallel shard counted once, every pipeline
stage included, each element once across the data-parallel replicas (the replicas' copies under
zero 0, each rank's range under zero >= 1; an expert's ranges over its d/ep replicas), and a tied
weight's head copy left out — in one scalar all-reduce over every rank.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from modelpar.tensor_parallel import param_layout
from modelpar.training.buckets import Bucket
from modelpar.training.grads import GradSync

__all__ = ["GradClip"]


class GradClip:
    """The global gradient norm of ``sync``'s buckets, and clipping to a maximum norm."""

    def __init__(self, sync: GradSync) -> None:
        self.sync = sync
        self.ranges = self._norm_ranges()

    def _counted(self, p: nn.Parameter) -> bool:
        """Does this rank's copy of ``p`` count in the global norm (one copy of each distinct shard)?"""
        sync = self.sync
        if id(p) in sync.expert_ids and sync.ep > 1:  # one copy of each expert: tp rank 0 of the first ep replicas
            return sync.tp_rank == 0 and (sync.zero > 0 or sync.dp_rank < sync.ep)  # (ZeRO: of every range)
        if id(p) in sync.tied_copy_ids or (not sync.zero and sync.dp_rank != 0):
            return False
        if id(p) in sync.expert_ids:  # replicated over t
            return sync.tp_rank == 0
        layout = param_layout(p)
        return layout.rank % layout.replicas == 0 if layout.dim is not None else sync.tp_rank == 0

    def _norm_ranges(self) -> list[tuple[Bucket, int, int]]:
        """The flat ranges of gradient this rank adds to the global norm, adjacent ones merged (few kernels)."""
        sync = self.sync
        ranges: list[tuple[Bucket, int, int]] = []
        for b in sync.buckets:
            lo, hi = sync.shard_range(b) if sync.zero else (0, b.numel)
            for p, offset in zip(b.params, b.offsets):
                a, z = max(lo, offset), min(hi, offset + p.numel())
                if a >= z or not self._counted(p):
                    continue
                if ranges and ranges[-1][0] is b and ranges[-1][2] == a:
                    ranges[-1] = (b, ranges[-1][1], z)
                else:
                    ranges.append((b, a, z))
        return ranges

    def global_norm(self) -> float:
        """Collective over all ranks (one scalar all-reduce): the L2 norm of the whole model's gradient."""
        local = torch.zeros((), dtype=torch.float64, device=self.sync.buckets[0].grad.device)
        for b, a, z in self.ranges:
            local += torch.linalg.vector_norm(self.sync.grad_range(b, a, z), dtype=torch.float64).square()
        dist.all_reduce(local)
        return math.sqrt(local.item())

    def clip(self, max_norm: float) -> float:
        """Scale all gradients so their global norm is at most ``max_norm``; return the norm before."""
        norm = self.global_norm()
        if max_norm > 0 and norm > max_norm:
            coef = max_norm / (norm + 1e-6)
            for b in self.sync.buckets:
                self.sync.owned_grad(b).mul_(coef)
        return norm
