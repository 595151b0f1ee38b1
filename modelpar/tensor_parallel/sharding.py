"""Where each parameter shard sits in the full tensor, and moving whole state dicts in and out.

Every parallel layer gives each of its parameters a ``ParamLayout``: the dimension of the *full*
(single-process) tensor split across the t ranks (or None: replicated), how many fused blocks
that dimension holds ([Wq; Wk; Wv] is 3, each split separately), how many consecutive ranks hold
the same shard (the key/value heads of grouped-query attention when t exceeds them), and whether
a replicated parameter sees only a sequence shard. ``param_layout(param)`` is the one way to read
it. The layouts live on the module, so they survive ``to_empty``: a model built on
``device="meta"`` can be materialised and then filled with ``load_full_state_dict`` or with
``ParamLayout.shard_of`` of a seeded full initialisation.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modelpar._compat import AfterApply
from modelpar._validate import check_int
from modelpar.tensor_parallel._comm import all_gather, all_reduce, group_rank, group_size, resolve_group

__all__ = [
    "ParamLayout",
    "TensorParallelModule",
    "gather_full_state_dict",
    "load_full_state_dict",
    "param_layout",
    "set_shape_checks",
    "shard_state_dict",
    "shard_tensor",
    "sync_tensor_parallel_grads",
    "unshard_tensor",
]

_ATTRIBUTE = "tensor_parallel_layout"


@dataclass(frozen=True)
class ParamLayout:
    """Where one rank's parameter tensor sits in the full (single-process) tensor.

    The full tensor's ``dim`` is cut into ``shards`` = t / ``replicas`` equal parts; rank r holds
    part ``shard`` = r // ``replicas`` (``replicas`` consecutive ranks hold the same part, as the
    key/value heads of grouped-query attention when t exceeds their number). With ``blocks`` > 1
    the dimension is that many fused blocks ([Wq; Wk; Wv]) and a part is the concatenation of its
    slice of each.
    """

    dim: int | None = None  # dimension of the full tensor split across the tp ranks; None: all of it here
    blocks: int = 1  # fused equal blocks along ``dim``, each split on its own ([Wq; Wk; Wv]: 3)
    replicas: int = 1  # consecutive tp ranks holding the same part
    rank: int = 0  # this rank's index in the tensor-parallel group
    world: int = 1  # t: tensor-parallel group size
    sequence_parallel: bool = False  # replicated but fed a sequence shard: its gradient is summed over ranks

    @property
    def shards(self) -> int:
        """Distinct parts the full tensor is cut into (1 when replicated)."""
        return 1 if self.dim is None else self.world // self.replicas

    @property
    def shard(self) -> int:
        """The part this rank holds."""
        return 0 if self.dim is None else self.rank // self.replicas

    @property
    def partial_grad(self) -> bool:
        """True if this rank's gradient is one part of a sum over ranks (``sync_tensor_parallel_grads``)."""
        return self.world > 1 and (self.sequence_parallel or (self.dim is not None and self.replicas > 1))

    def full_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        """The single-process shape of a parameter whose part here has ``local_shape``."""
        shape = list(local_shape)
        if self.dim is not None:
            shape[self.dim] *= self.shards
        return tuple(shape)

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor (a new contiguous tensor; the tensor itself if replicated)."""
        if self.dim is None or self.shards == 1:
            return full
        return shard_tensor(full, self.dim, self.shard, self.shards, self.blocks)

    def pieces(self, full_size: int) -> list[tuple[int, int, int]]:
        """(start in this part, start in the full tensor, length) along ``dim``, one per fused block."""
        if self.dim is None:
            return [(0, 0, full_size)]
        block = full_size // self.blocks
        length = block // self.shards
        return [(b * length, b * block + self.shard * length, length) for b in range(self.blocks)]


def param_layout(param: torch.Tensor) -> ParamLayout:
    """The layout of ``param``: the one its parallel layer gave it, or "replicated" for any other tensor."""
    return getattr(param, _ATTRIBUTE, None) or ParamLayout()


class TensorParallelModule(AfterApply):
    """Base of the parallel layers: the group, this rank's index ``tp_rank`` in it, its size
    ``tp_world``, a ``ParamLayout`` per parameter (``tp_layouts``, also attached to the
    parameters) and ``check_shapes``, the cross-rank shape check before each forward collective."""

    def _init_tensor_parallel(self, group: Any) -> None:
        self.group = resolve_group(group)
        self.tp_rank = group_rank(self.group)
        self.tp_world = group_size(self.group)
        self.tp_layouts: dict[str, ParamLayout] = {}
        self.check_shapes = True

    @property
    def reads_host(self) -> bool:
        """Whether this module's forward still reads the host: its cross-rank shape check (``check_shapes``, over
        more than one rank). A traced forward splits its graph there; ``--compile-scope stage`` waits it out."""
        return self.check_shapes and self.tp_world > 1

    def _set_layout(self, name: str, dim: int | None, blocks: int = 1, replicas: int = 1,
                    sequence_parallel: bool = False) -> None:
        self.tp_layouts[name] = ParamLayout(dim, blocks, replicas, self.tp_rank, self.tp_world, sequence_parallel)
        self._attach_layouts()

    def _attach_layouts(self) -> None:
        for name, layout in self.tp_layouts.items():
            param = getattr(self, name, None)
            if param is not None:
                setattr(param, _ATTRIBUTE, layout)

    def _after_apply(self) -> None:
        self._attach_layouts()  # to_empty / to() may have built new Parameters


def set_shape_checks(module: nn.Module, enabled: bool) -> None:
    """Turn the cross-rank shape check on or off in every parallel layer of ``module``.

    A collective whose ranks pass different shapes aborts gloo (and hangs NCCL); the check is one
    all-gather of 11 integers before each forward collective that turns this into a ValueError on
    every rank. A training loop keeps it for the first step and turns it off for the identical rest.
    """
    for sub in module.modules():
        if isinstance(sub, TensorParallelModule):
            sub.check_shapes = bool(enabled)


def shard_tensor(full: torch.Tensor, dim: int, rank: int, world: int, blocks: int = 1) -> torch.Tensor:
    """Rank ``rank``'s slice of ``full`` along ``dim`` out of ``world``, a new contiguous tensor.

    With ``blocks`` > 1 the dimension holds that many blocks (e.g. [Wq; Wk; Wv]) and the shard
    is the concatenation of the rank's slice of each block, so it still holds whole heads.
    """
    world = check_int("world", world, minimum=1)
    rank = check_int("rank", rank, minimum=0, maximum=world - 1)
    blocks = check_int("blocks", blocks, minimum=1)
    if not -full.dim() <= dim < full.dim():
        raise ValueError(f"dim must be in [{-full.dim()}, {full.dim() - 1}] for a tensor of shape {tuple(full.shape)}, got {dim}")
    if full.shape[dim] % (world * blocks):
        raise ValueError(f"dimension {dim} of a tensor of shape {tuple(full.shape)} ({full.shape[dim]}) must be "
                         f"divisible by world * blocks = {world} * {blocks}")
    parts = [block.chunk(world, dim)[rank] for block in full.chunk(blocks, dim)]
    return torch.cat(parts, dim).clone(memory_format=torch.contiguous_format)


def unshard_tensor(shards: Sequence[torch.Tensor], dim: int, blocks: int = 1) -> torch.Tensor:
    """The inverse of ``shard_tensor``: the full tensor from the shards of ranks 0..world−1."""
    per_rank = [s.chunk(blocks, dim) for s in shards]
    return torch.cat([part[b] for b in range(blocks) for part in per_rank], dim)


def _layouts(module: nn.Module) -> Iterator[tuple[str, nn.Parameter, ParamLayout, TensorParallelModule]]:
    """(full parameter name, parameter, layout, owning layer) for every parameter a parallel layer describes."""
    for prefix, sub in module.named_modules():
        if isinstance(sub, TensorParallelModule):
            for name, layout in sub.tp_layouts.items():
                param = getattr(sub, name, None)
                if param is not None:
                    yield (f"{prefix}.{name}" if prefix else name), param, layout, sub


def shard_state_dict(module: nn.Module, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's shards of a full (single-process) state dict, keyed like ``module.state_dict()``."""
    layouts = {name: layout for name, _, layout, _ in _layouts(module)}
    own = module.state_dict(keep_vars=True)
    missing = [k for k in own if k not in full]
    if missing:
        raise ValueError(f"full state dict is missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    out = {}
    for key, mine in own.items():
        tensor = layouts[key].shard_of(full[key]) if key in layouts else full[key]
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
    owners = {name: (layout, owner) for name, _, layout, owner in _layouts(module)}
    out = {}
    for key, tensor in module.state_dict().items():
        layout, owner = owners.get(key, (ParamLayout(), None))
        if layout.dim is not None and layout.shards > 1 and owner is not None:
            gathered = all_gather(tensor.contiguous(), layout.dim, owner.group, "other")
            ranks = gathered.chunk(owner.tp_world, layout.dim)[:: layout.replicas]  # one rank per distinct shard
            tensor = unshard_tensor(ranks, layout.dim, layout.blocks)
        out[key] = tensor.detach().clone()
    return out


def sync_tensor_parallel_grads(module: nn.Module) -> None:
    """Sum the gradients that several tensor-parallel ranks each hold only a part of; call after backward.

    Two kinds (``ParamLayout.partial_grad``): replicated parameters fed a sequence shard under
    sequence parallelism (LayerNorm/RMSNorm weights, row-parallel biases: each rank saw s/t tokens,
    Korthikanti §4.2.2), summed over the group; and key/value heads replicated on ``replicas``
    consecutive ranks (each rank back-propagated only its own query heads), summed over those
    ranks. One flat all-reduce per group: a replicated shard travels in a zero buffer of all
    ``shards`` slots, so the sum over the group adds up exactly the ranks holding the same shard.
    """
    by_group: dict[int, tuple[Any, list[tuple[nn.Parameter, ParamLayout]]]] = {}
    for _, param, layout, owner in _layouts(module):
        if layout.partial_grad:
            by_group.setdefault(id(owner.group), (owner.group, []))[1].append((param, layout))
    for group, params in by_group.values():
        parts = []
        for p, layout in params:
            grad = (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
            if layout.dim is not None:  # place it in its shard's slot of a zero buffer
                slots = grad.new_zeros(layout.shards, grad.numel())
                slots[layout.shard] = grad
                grad = slots.view(-1)
            parts.append(grad)
        flat = all_reduce(torch.cat(parts), group, "backward")
        for (p, layout), summed in zip(params, flat.split([g.numel() for g in parts])):
            if layout.dim is not None:
                summed = summed.view(layout.shards, -1)[layout.shard]
            if p.grad is None:
                p.grad = summed.view_as(p).clone()
            else:
                p.grad.copy_(summed.view_as(p))
