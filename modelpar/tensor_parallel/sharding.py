"""How parameters are split across tensor-parallel ranks, and moving whole state dicts in and out.

Every parallel layer records, per parameter, the dimension of the *full* (single-process)
tensor that is split across ranks (``tensor_parallel_dim`` ∈ {0, 1, None}), and whether a
replicated parameter sees only a sequence shard under sequence parallelism (its gradients are
then summed over the group by ``sync_sequence_parallel_grads``, as Megatron does after
backward). The record lives on the module, so it survives ``to_empty``: a model built on
``device="meta"`` can be materialised and then filled with ``load_full_state_dict`` or with
``shard_tensor`` of a seeded full initialisation.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modelpar._validate import check_int
from modelpar.tensor_parallel._comm import all_gather, all_reduce, group_rank, group_size, resolve_group

__all__ = [
    "ParamLayout",
    "ShardSpec",
    "TensorParallelModule",
    "gather_full_state_dict",
    "load_full_state_dict",
    "param_layout",
    "shard_state_dict",
    "shard_tensor",
    "sync_sequence_parallel_grads",
    "unshard_tensor",
]


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter of the full module maps onto this rank's shard."""

    dim: int | None  # dimension of the full tensor split across ranks; None: replicated
    chunks: int = 1  # that dimension is ``chunks`` equal blocks, each split separately (fused q, k, v: 3)
    sequence_parallel: bool = False  # replicated, but fed a sequence shard: gradients are summed over ranks


class TensorParallelModule(nn.Module):
    """Base of the parallel layers: the group, this rank's index ``tp_rank`` in it, its size
    ``tp_world``, and a ``ShardSpec`` per parameter (also set as parameter attributes)."""

    def _init_tensor_parallel(self, group: Any) -> None:
        self.group = resolve_group(group)
        self.tp_rank = group_rank(self.group)
        self.tp_world = group_size(self.group)
        self.tp_specs: dict[str, ShardSpec] = {}

    def _set_spec(self, name: str, spec: ShardSpec) -> None:
        self.tp_specs[name] = spec
        self._attach_specs()

    def _attach_specs(self) -> None:
        for name, spec in self.tp_specs.items():
            param = getattr(self, name, None)
            if param is not None:
                param.tensor_parallel_dim = spec.dim
                param.tensor_parallel_chunks = spec.chunks
                param.sequence_parallel = spec.sequence_parallel
                param.tensor_parallel_rank = self.tp_rank
                param.tensor_parallel_world = self.tp_world

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> nn.Module:
        out = super()._apply(fn, *args, **kwargs)  # to_empty / to() may build new Parameters
        self._attach_specs()
        return out


@dataclass(frozen=True)
class ParamLayout:
    """Where one rank's parameter tensor sits in the full (single-process) tensor.

    The full tensor's ``dim`` is cut into ``shards`` = t / ``replicas`` equal parts; rank r holds
    part ``shard`` = r // ``replicas`` (``replicas`` consecutive ranks hold the same part, as the
    key/value heads of grouped-query attention when t exceeds their number). With ``blocks`` > 1
    the dimension is that many fused blocks (q, k, v), each cut separately.
    """

    dim: int | None = None  # dimension of the full tensor split across the tp ranks; None: all of it here
    blocks: int = 1  # fused equal blocks along ``dim``, each split on its own
    replicas: int = 1  # consecutive tp ranks holding the same part
    rank: int = 0  # this rank's index in the tensor-parallel group
    world: int = 1  # t: tensor-parallel group size

    @property
    def shards(self) -> int:
        """Distinct parts the full tensor is cut into (1 when replicated)."""
        return 1 if self.dim is None else self.world // self.replicas

    @property
    def shard(self) -> int:
        """The part this rank holds."""
        return 0 if self.dim is None else self.rank // self.replicas


def param_layout(param: torch.Tensor) -> ParamLayout:
    """The layout of a parameter: set by the parallel layers, replicated for any other tensor."""
    return ParamLayout(dim=getattr(param, "tensor_parallel_dim", None),
                       blocks=getattr(param, "tensor_parallel_chunks", 1),
                       replicas=getattr(param, "tensor_parallel_replicas", 1),
                       rank=getattr(param, "tensor_parallel_rank", 0),
                       world=getattr(param, "tensor_parallel_world", 1))


def shard_tensor(full: torch.Tensor, dim: int, rank: int, world: int, chunks: int = 1) -> torch.Tensor:
    """Rank ``rank``'s slice of ``full`` along ``dim`` out of ``world``, a new contiguous tensor.

    With ``chunks`` > 1 the dimension holds ``chunks`` blocks (e.g. [Wq; Wk; Wv]) and the shard is
    the concatenation of the rank's slice of each block, so it still holds whole heads.
    """
    world = check_int("world", world, minimum=1)
    rank = check_int("rank", rank, minimum=0, maximum=world - 1)
    chunks = check_int("chunks", chunks, minimum=1)
    if not -full.dim() <= dim < full.dim():
        raise ValueError(f"dim must be in [{-full.dim()}, {full.dim() - 1}] for a tensor of shape {tuple(full.shape)}, got {dim}")
    if full.shape[dim] % (world * chunks):
        raise ValueError(f"dimension {dim} of a tensor of shape {tuple(full.shape)} ({full.shape[dim]}) must be "
                         f"divisible by world * chunks = {world} * {chunks}")
    parts = [block.chunk(world, dim)[rank] for block in full.chunk(chunks, dim)]
    return torch.cat(parts, dim).clone(memory_format=torch.contiguous_format)


def unshard_tensor(shards: Sequence[torch.Tensor], dim: int, chunks: int = 1) -> torch.Tensor:
    """The inverse of ``shard_tensor``: the full tensor from the shards of ranks 0..world−1."""
    per_rank = [s.chunk(chunks, dim) for s in shards]
    return torch.cat([part[c] for c in range(chunks) for part in per_rank], dim)


def _specs(module: nn.Module) -> Iterator[tuple[str, ShardSpec, TensorParallelModule]]:
    """(full parameter name, spec, owning layer) for every parameter a parallel layer describes."""
    for prefix, sub in module.named_modules():
        if isinstance(sub, TensorParallelModule):
            for name, spec in sub.tp_specs.items():
                if getattr(sub, name, None) is not None:
                    yield (f"{prefix}.{name}" if prefix else name), spec, sub


def shard_state_dict(module: nn.Module, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's shards of a full (single-process) state dict, keyed like ``module.state_dict()``."""
    specs = {name: (spec, owner) for name, spec, owner in _specs(module)}
    own = module.state_dict(keep_vars=True)
    missing = [k for k in own if k not in full]
    if missing:
        raise ValueError(f"full state dict is missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    out = {}
    for key, mine in own.items():
        tensor = full[key]
        if key in specs and (dim := specs[key][0].dim) is not None:
            spec, owner = specs[key]
            tensor = shard_tensor(tensor, dim, owner.tp_rank, owner.tp_world, spec.chunks)
        if tuple(tensor.shape) != tuple(mine.shape):
            raise ValueError(f"state dict entry {key!r} has shape {tuple(full[key].shape)}, which does not give "
                             f"this rank's shard shape {tuple(mine.shape)}")
        out[key] = tensor
    return out


def load_full_state_dict(module: nn.Module, full: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Copy a full single-process state dict into this rank's shards (in place)."""
    if strict:
        extra = [k for k in full if k not in module.state_dict()]
        if extra:
            raise ValueError(f"full state dict has keys the module lacks: {extra[:5]} (pass strict=False to ignore)")
    module.load_state_dict(shard_state_dict(module, full), strict=True)


def gather_full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The full single-process state dict, assembled on every rank (one all-gather per sharded tensor)."""
    specs = {name: (spec, owner) for name, spec, owner in _specs(module)}
    out = {}
    for key, tensor in module.state_dict().items():
        if key in specs and (dim := specs[key][0].dim) is not None and specs[key][1].tp_world > 1:
            spec, owner = specs[key]
            gathered = all_gather(tensor.contiguous(), dim, owner.group, "other")
            tensor = unshard_tensor(gathered.chunk(owner.tp_world, dim), dim, spec.chunks)
        out[key] = tensor.detach().clone()
    return out


def sync_sequence_parallel_grads(module: nn.Module) -> None:
    """Sum over the group the gradients of replicated parameters that saw only a sequence shard.

    Under sequence parallelism LayerNorm γ/β and the row-parallel bias act on 1/t of the tokens,
    so each rank's gradient is a partial sum (Korthikanti §4.2.2). Call after backward, before
    the optimizer step; one all-reduce per group, of all such gradients flattened together.
    """
    by_group: dict[int, tuple[Any, list[nn.Parameter]]] = {}
    for name, spec, owner in _specs(module):
        if spec.sequence_parallel and owner.tp_world > 1:
            param = getattr(owner, name.rsplit(".", 1)[-1])
            by_group.setdefault(id(owner.group), (owner.group, []))[1].append(param)
    for group, params in by_group.values():
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = all_reduce(torch.cat([g.reshape(-1) for g in grads]), group, "backward")
        for p, g in zip(params, flat.split([g.numel() for g in grads])):
            if p.grad is None:
                p.grad = g.view_as(p).clone()
            else:
                p.grad.copy_(g.view_as(p))
