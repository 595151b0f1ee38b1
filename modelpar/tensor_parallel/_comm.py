"""Raw collectives over a tensor-parallel group, with accounting and a cross-rank shape check.

Plain functions (no autograd): ``collectives.py`` wraps them in the autograd Functions of §5.4.
They only use ``torch.distributed`` calls that NCCL and gloo both implement, on the tensor's own
device, so the same code runs on CPUs and GPUs. ``group=None`` means "not tensor-parallel":
one rank, no communication (unlike ``torch.distributed``, where None is the world group).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from modelpar._compat import all_gather_single, reduce_scatter_single
from modelpar._tensor_meta import META_LEN, describe_meta, encode_meta
from modelpar.tensor_parallel.accounting import record

__all__ = ["all_gather", "all_reduce", "check_same_shape", "group_rank", "group_size",
           "reduce_scatter", "resolve_group", "split"]


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def resolve_group(group: Any) -> dist.ProcessGroup | None:
    """A ProcessGroup (or None) from ``group``: None, a ProcessGroup or a 1-D DeviceMesh.

    Raises ValueError when this process is not a member: a layer built on the wrong group
    would otherwise hang in its first collective.
    """
    if group is None:
        return None
    if hasattr(group, "get_group"):  # torch.distributed.device_mesh.DeviceMesh
        if group.ndim != 1:
            raise ValueError(f"group must be a 1-D DeviceMesh (e.g. mesh['tp']), got one of {group.ndim} dims")
        group = group.get_group()
    if not dist.is_initialized():
        raise ValueError("group was given but torch.distributed is not initialised; use group=None for one process")
    if dist.get_rank(group) < 0:
        ranks = dist.get_process_group_ranks(group)
        raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member of group ranks {ranks}")
    return group


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def check_same_shape(x: torch.Tensor, group: dist.ProcessGroup | None, what: str,
                     local_error: str | None = None, enabled: bool = True) -> None:
    """Raise ValueError on every rank if ranks of ``group`` hold ``x`` with different shapes or dtypes,
    or if any rank found ``local_error`` in its input (so one rank's bad input stops all, no hang).

    A collective whose ranks pass different shapes aborts gloo (and hangs NCCL); the check is one
    all-gather of 11 integers. With ``enabled`` False only this rank's ``local_error`` is raised.
    """
    n = group_size(group)
    if n == 1 or not enabled:
        if local_error:
            raise ValueError(local_error)
        return
    meta = torch.tensor([int(bool(local_error)), *encode_meta(x)], dtype=torch.int64, device=x.device)
    out = torch.empty(n * (1 + META_LEN), dtype=torch.int64, device=x.device)
    all_gather_single(out, meta, group=group)
    record("shape_check", "forward", out.numel(), 8, n, op="")
    rows = out.view(n, 1 + META_LEN).tolist()
    flagged = [i for i, r in enumerate(rows) if r[0]]
    if flagged:
        raise ValueError(local_error or f"{what} is invalid on tensor-parallel rank(s) {flagged} (see their error)")
    if any(r != rows[0] for r in rows):
        desc = ", ".join(f"rank {i}: {describe_meta(r[1:])}" for i, r in enumerate(rows))
        raise ValueError(f"{what} must have the same shape and dtype on every tensor-parallel rank, got {desc}")


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None, phase: str, op: str = "sum") -> torch.Tensor:
    """A new tensor holding the element-wise sum (or max) of ``x`` over the group."""
    n = group_size(group)
    if n == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, op=_OPS[op], group=group)
    record("all_reduce", phase, out.numel(), out.element_size(), n, op)
    return out


def all_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None, phase: str) -> torch.Tensor:
    """The ranks' ``x`` concatenated along ``dim`` in rank order."""
    n = group_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    flat = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)
    all_gather_single(flat, x.contiguous().view(-1), group=group)
    record("all_gather", phase, flat.numel(), x.element_size(), n, op="")
    stacked = flat.view(n, *x.shape)  # [n, ...]: move the rank index next to dim and merge them
    return stacked.movedim(0, dim).flatten(dim, dim + 1) if dim else stacked.flatten(0, 1)


def reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None, phase: str) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's 1/n slice along ``dim``."""
    n = group_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    _check_divisible(x, dim, n)
    chunks = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()  # [n, ...]
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    reduce_scatter_single(out.view(-1), chunks.view(-1), group=group)
    record("reduce_scatter", phase, chunks.numel(), x.element_size(), n)
    return out


def split(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's 1/n slice of ``x`` along ``dim`` (no communication)."""
    n = group_size(group)
    if n == 1:
        return x
    _check_divisible(x, dim % x.dim(), n)
    return x.chunk(n, dim)[group_rank(group)].contiguous()


def _check_divisible(x: torch.Tensor, dim: int, n: int) -> None:
    if x.shape[dim] % n:
        raise ValueError(f"tensor of shape {tuple(x.shape)}: dimension {dim} ({x.shape[dim]}) must be "
                         f"divisible by the tensor-parallel size ({n})")
