"""The expert-parallel all-to-all: rows of a tensor go to the ranks of a group by split sizes, differentiably.

Forward sends ``in_splits[j]`` consecutive rows to rank j and receives ``out_splits[j]`` from it
(``torch.distributed.all_to_all_single``, which gloo and NCCL both implement); the backward is
the same exchange with the two split lists swapped (the gradient of a row goes back to where
the row came from). A group of one rank (or None) is the identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_to_all", "exchange_counts"]


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group: Any) -> torch.Tensor:
    """Rows ``x[sum(in_splits[:j]) : sum(in_splits[:j+1])]`` to rank j of ``group``; what each rank sent
    here, in rank order (``out_splits[j]`` rows from rank j). Autograd sends gradients back."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, [int(n) for n in out_splits], [int(n) for n in in_splits], group)


def exchange_counts(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """Each rank's [world, n] counts (row j: what it sends to rank j) → [world, n] (row j: what rank j sends here)."""
    if group is None or dist.get_world_size(group) == 1:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out
