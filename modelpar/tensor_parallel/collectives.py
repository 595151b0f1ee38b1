"""The communication operators of Megatron tensor parallelism as autograd Functions (§5.4).

Each takes an explicit ``group``; ``group=None`` or a group of one rank skips communication.
f and g are conjugate: what one does forward, the other does backward (Shoeybi et al. 2019,
Fig. 3). The sequence-parallel pair does the same along the sequence dimension (Korthikanti
et al. 2022, §4.2.2): all-reduce = reduce-scatter + all-gather, so the volume is unchanged.

    op                                         forward                backward
    copy_to_tensor_parallel_region      (f)    identity               all-reduce
    reduce_from_tensor_parallel_region  (g)    all-reduce             identity
    gather_from_tensor_parallel_region         all-gather last dim    split last dim
    scatter_to_tensor_parallel_region          split last dim         all-gather last dim
    gather_from_sequence_parallel_region (ḡ)   all-gather seq dim     reduce-scatter seq dim
    reduce_scatter_to_sequence_parallel_region reduce-scatter seq     all-gather seq dim
    scatter_to_sequence_parallel_region        split seq dim          all-gather seq dim

Tensors are batch-first ``[b, s, h]``: the sequence dimension is 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Function

from modelpar.tensor_parallel._comm import all_gather, all_reduce, check_same_shape, group_size, reduce_scatter, split
from modelpar.tensor_parallel.accounting import active_logs, resume_logs

__all__ = [
    "SEQUENCE_DIM",
    "copy_to_tensor_parallel_region",
    "enter_column_parallel_region",
    "exit_row_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
]

SEQUENCE_DIM = 1  # batch-first [b, s, h]

Group = dist.ProcessGroup | None


class _CopyToTensorParallelRegion(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group, ctx.logs = group, active_logs()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        with resume_logs(ctx.logs):
            return all_reduce(grad, ctx.group, "backward"), None


class _ReduceFromTensorParallelRegion(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, check: bool) -> torch.Tensor:
        check_same_shape(x, group, "the input of g (reduce_from_tensor_parallel_region)", enabled=check)
        return all_reduce(x, group, "forward")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _Gather(Function):
    """All-gather along ``dim`` forward; backward keeps this rank's slice of the gradient, or, for
    the sequence-parallel ḡ, reduce-scatters it (the gathered tensor feeds a tensor-parallel layer
    whose ranks each hold a partial gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Group, reduce_grad: bool, check: bool) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.reduce_grad, ctx.logs = dim, group, reduce_grad, active_logs()
        check_same_shape(x, group, "the input of an all-gather", enabled=check)
        return all_gather(x, dim, group, "forward")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        if not ctx.reduce_grad:
            return split(grad, ctx.dim, ctx.group), None, None, None, None
        with resume_logs(ctx.logs):
            return reduce_scatter(grad, ctx.dim, ctx.group, "backward"), None, None, None, None


class _Split(Function):
    """Keep this rank's slice along ``dim`` forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.logs = dim, group, active_logs()
        return split(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        with resume_logs(ctx.logs):
            return all_gather(grad.contiguous(), ctx.dim, ctx.group, "backward"), None, None


class _ReduceScatter(Function):
    """Reduce-scatter along ``dim`` forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Group, check: bool) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.logs = dim, group, active_logs()
        check_same_shape(x, group, "the input of a reduce-scatter", enabled=check)
        return reduce_scatter(x, dim, group, "forward")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        with resume_logs(ctx.logs):
            return all_gather(grad.contiguous(), ctx.dim, ctx.group, "backward"), None, None, None


def _single(group: Group) -> bool:
    return group is None or group_size(group) == 1


def copy_to_tensor_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """f in Megatron (Fig. 3): identity forward, all-reduce backward.

    Placed where a replicated activation enters a column-parallel layer: each rank's weight
    slice yields only a partial ∂L/∂x, and the all-reduce sums the t parts (§5.4).
    """
    return x if _single(group) else _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Group = None, check_shapes: bool = True) -> torch.Tensor:
    """g in Megatron (Fig. 3): all-reduce forward, identity backward.

    Sums the partial outputs of a row-parallel layer (Z = Z₁ + … + Z_t, §5.2); the gradient of a
    sum with respect to each term is the gradient itself. ``check_shapes``: compare the shapes
    across ranks first (``check_same_shape``), as every forward collective below.
    """
    return x if _single(group) else _ReduceFromTensorParallelRegion.apply(x, group, check_shapes)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Group = None, check_shapes: bool = True) -> torch.Tensor:
    """All-gather the last dimension forward (column outputs → the full Y, §5.1); split backward."""
    return x if _single(group) else _Gather.apply(x, -1, group, False, check_shapes)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Keep this rank's slice of the last dimension forward (X → X_i for a row layer); all-gather backward."""
    return x if _single(group) else _Split.apply(x, -1, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Group = None, check_shapes: bool = True) -> torch.Tensor:
    """ḡ of sequence parallelism (Korthikanti §4.2.2): all-gather the sequence shards forward,
    reduce-scatter the gradient backward. Replaces f in front of a column-parallel layer."""
    return x if _single(group) else _Gather.apply(x, SEQUENCE_DIM, group, True, check_shapes)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group = None,
                                               check_shapes: bool = True) -> torch.Tensor:
    """The sequence-parallel g (Korthikanti §4.2.2): reduce-scatter the partial sums along the
    sequence forward, all-gather the gradient backward. Replaces g after a row-parallel layer."""
    return x if _single(group) else _ReduceScatter.apply(x, SEQUENCE_DIM, group, check_shapes)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Keep this rank's sequence shard forward; all-gather the gradient backward (enter the SP region)."""
    return x if _single(group) else _Split.apply(x, SEQUENCE_DIM, group)


def enter_column_parallel_region(x: torch.Tensor, group: Group = None, sequence_parallel: bool = False,
                                 check_shapes: bool = True) -> torch.Tensor:
    """What stands in front of column-parallel layers: f, or ḡ for a sequence shard.

    Several column layers reading the same input (q and kv of grouped-query attention) share one.
    """
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, group, check_shapes)
    return copy_to_tensor_parallel_region(x, group)


def exit_row_parallel_region(x: torch.Tensor, group: Group = None, sequence_parallel: bool = False,
                             check_shapes: bool = True) -> torch.Tensor:
    """What follows a row-parallel layer's partial sums: g, or the reduce-scatter to a sequence shard."""
    if sequence_parallel:
        return reduce_scatter_to_sequence_parallel_region(x, group, check_shapes)
    return reduce_from_tensor_parallel_region(x, group, check_shapes)
