"""What a rank puts in a checkpoint: the parts of full tensors it holds, and DCP planners for them.

A checkpoint entry is a *full* tensor (the single-process one) under its global name. Each rank
describes the part it holds as a ``Shard``: the full shape and one or more boxes (offsets in the
full tensor + a view of this rank's data)::

    qkv.weight, full [3h, h], t = 2, rank 1:   rows [h/2, h) of q,  [3h/2, 2h) of k,  [5h/2, 3h) of v
                                               -> Shard((3h, h), [Piece((h/2, 0), q_1), Piece((3h/2, 0), k_1), ...])

DCP stores every box as a chunk of the full tensor (boxes that several ranks hold — data-parallel
replicas, replicated LayerNorms, a tied weight's copies — are written once, each by whichever of
its holders has the least to write, so the data-parallel replicas share the writing).
On load each rank asks for its own boxes and DCP reads the overlaps from whatever chunks were
saved: any split to any other. A rank leaves out what it does not hold (ZeRO-1 keeps each
optimizer state on one data-parallel rank) and asks only for what it holds in the new layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType

from modelpar._compat import read_items_for_chunks
from modelpar._validate import check_int

__all__ = ["SAVED", "Piece", "Shard", "ShardLoadPlanner", "ShardSavePlanner", "ShardedState", "to_save"]

SAVED = "modelpar"  # the one top-level key of the state dict handed to dcp.save (``to_save``)
_UNCHANGED = "modelpar: as last time"  # ``SavePlan.planner_data`` of a plan sent empty (``ShardSavePlanner``)


@dataclass(frozen=True)
class Piece:
    """One box of a full tensor held by this rank: where it starts, and the data (loading writes into it)."""

    offsets: tuple[int, ...]
    tensor: torch.Tensor


@dataclass
class Shard:
    """The part of one full tensor of shape ``shape`` this rank holds: a list of boxes."""

    shape: tuple[int, ...]
    pieces: list[Piece]

    @classmethod
    def whole(cls, tensor: torch.Tensor) -> Shard:
        """All of ``tensor`` (a replicated one, or the full tensor on one process)."""
        return cls(tuple(tensor.shape), [Piece((0,) * tensor.dim(), tensor)])

    @classmethod
    def split(cls, local: torch.Tensor, dim: int, index: int, count: int, blocks: int = 1) -> Shard:
        """``local`` is part ``index`` of ``count`` equal parts along ``dim`` of the full tensor.

        With ``blocks`` > 1 that dimension is made of equal fused blocks (q, k, v) and ``local`` holds
        part ``index`` of each block, concatenated: one box per block.
        """
        count = check_int("count", count, minimum=1)
        index = check_int("index", index, minimum=0, maximum=count - 1)
        blocks = check_int("blocks", blocks, minimum=1)
        if not 0 <= dim < local.dim() or local.shape[dim] % blocks:
            raise ValueError(f"dim {dim} of a local tensor of shape {tuple(local.shape)} must exist and be "
                             f"divisible by blocks ({blocks})")
        shape = list(local.shape)
        shape[dim] *= count
        block_local, block_full = local.shape[dim] // blocks, shape[dim] // blocks
        pieces = []
        for b, part in enumerate(local.split(block_local, dim)):
            offsets = [0] * local.dim()
            offsets[dim] = b * block_full + index * block_local
            pieces.append(Piece(tuple(offsets), part))
        return cls(tuple(shape), pieces)

    def piece_at(self, offsets: tuple[int, ...]) -> Piece:
        for piece in self.pieces:
            if piece.offsets == offsets:
                return piece
        raise KeyError(offsets)


@dataclass
class ShardedState:
    """Global name → the ``Shard`` of that full tensor this rank holds: what it saves and what it loads.

    A name added twice on one rank (a tied weight's two copies) is saved once; loading fills the
    first and copies it into the second.
    """

    shards: dict[str, Shard] = field(default_factory=dict)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (destination, source)

    def add(self, name: str, shard: Shard) -> None:
        held = self.shards.get(name)
        if held is None:
            self.shards[name] = shard
            return
        if held.shape != shard.shape or [p.offsets for p in held.pieces] != [p.offsets for p in shard.pieces]:
            raise ValueError(f"{name!r} added twice with different layouts: full shapes {held.shape} and "
                             f"{shard.shape}, boxes at {[p.offsets for p in held.pieces]} and "
                             f"{[p.offsets for p in shard.pieces]}")
        self.copies += [(p.tensor, q.tensor) for p, q in zip(shard.pieces, held.pieces)]

    def __contains__(self, name: object) -> bool:
        return name in self.shards

    def __len__(self) -> int:
        return len(self.shards)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shards)

    @torch.no_grad()
    def snapshot(self) -> ShardedState:
        """Every box copied to host memory now: what an asynchronous save writes while training changes the originals."""
        return ShardedState({name: Shard(shard.shape, [Piece(p.offsets, p.tensor.detach().to("cpu", copy=True))
                                                      for p in shard.pieces])
                             for name, shard in self.shards.items()})

    @torch.no_grad()
    def fill_copies(self) -> None:
        """After a load: the second copy of a name held twice takes the loaded first one."""
        for destination, source in self.copies:
            destination.copy_(source)


def to_save(shards: dict[str, Shard]) -> dict[str, Any]:
    """``{name: Shard}`` as the state dict ``ShardSavePlanner`` saves: under one key, ``SAVED``. DCP wraps every
    top-level entry of a saved state dict in a logging call of its own (``_stateful_to_state_dict``: a message dict
    with a fresh uuid and two records at DEBUG, the level DCP's logger is set to), tens of µs per entry and save
    on a rank's 130 entries; one key costs one. The checkpoint is the same: the planner names the entries."""
    return {SAVED: shards}


def _as_last_time() -> SavePlan:
    return SavePlan([], planner_data=_UNCHANGED)


def _chunk(piece: Piece) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=piece.tensor.shape)


def _piece(shards: dict[str, Shard], index: MetadataIndex) -> torch.Tensor:
    offsets = tuple(index.offset) if index.offset is not None else ()
    return shards[index.fqn].piece_at(offsets).tensor


class ShardSavePlanner(DefaultSavePlanner):
    """DCP save planner for a ``{name: Shard}`` dict (given as ``to_save(shards)``): one write item per box; a box
    held by several ranks is written once (DCP's de-duplication balances the bytes each rank writes).

    One planner may save again and again (``CheckpointManager`` keeps one): from the second save on, a
    rank whose plan equals the one it sent last sends an empty plan instead, and when every rank's is
    empty the coordinator sends back empty ones and reuses the global plan and the metadata it made
    last time (no de-duplication, no metadata, small collectives); each rank then writes by its last
    final plan, with this save's data. This is DCP's plan caching (``DefaultSavePlanner(enable_plan_caching=
    True)``), which cannot engage here as DCP has it: its comparison lives in
    ``DefaultSavePlanner.create_local_plan``, which this planner replaces, and its caches are class-wide
    dictionaries keyed by the class name, shared by every planner (every group, every model) of a
    process. Here they are this planner's own, and an empty plan says "as last time" in its
    ``planner_data`` (a field every DCP release has; DCP's own ``SavePlan.usable`` came later). A
    planning that fails leaves them as they were (a rank's plan counts as sent only in ``finish_plan``);
    after a failed save the manager drops the planner on every rank.

    ::

        save 1 (or any change)        later saves, nothing changed
        rank r: plan_r ----------->    rank r: [] "as last time" --->
        coordinator: dedup + metadata  coordinator: last global plan + metadata
                 <--- final plan_r              <--- [] "as last time": rank r writes by its last final plan
    """

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._sent: SavePlan | None = None  # the local plan of the last planning that completed
        self._trying: SavePlan | None = None  # this planning's local plan, until it completes
        self._final: SavePlan | None = None  # this rank's final plan from the last planning
        self._all: list[SavePlan] | None = None  # coordinator: every rank's local plan, as last planned
        self._global: tuple[list[SavePlan], Metadata] | None = None  # coordinator: the global plan and metadata

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.shards: dict[str, Shard] = state_dict[SAVED]  # ``to_save``
        self.state_dict = {}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(name, torch.Size(piece.offsets)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(chunk=_chunk(piece), size=torch.Size(shard.shape),
                                                       properties=TensorProperties.create_from_tensor(piece.tensor)))
                 for name, shard in self.shards.items() for piece in shard.pieces]
        self.plan = SavePlan(items)
        if self._sent is not None and self.plan == self._sent:
            self._trying = None
            return _as_last_time()  # unchanged: the coordinator has it
        self._trying = self.plan
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        unchanged = [plan.planner_data == _UNCHANGED for plan in all_plans]
        if any(unchanged) and (self._all is None or len(self._all) != len(all_plans)):
            raise RuntimeError("a rank sent an unchanged save plan, but the coordinator holds none for it "
                               "(the ranks' plan caches disagree)")
        if all(unchanged) and self._global is not None:
            self.global_plan, self.metadata = self._global
            return [_as_last_time() for _ in all_plans], self.metadata
        merged = [old if same else new for old, new, same in zip(self._all or all_plans, all_plans, unchanged)]
        global_plan, metadata = super().create_global_plan(merged)  # de-duplicated, validated (raises if not)
        self._all, self._global = merged, (global_plan, metadata)
        return global_plan, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        if new_plan.planner_data != _UNCHANGED:
            self._final = new_plan
        elif self._final is None:
            raise RuntimeError("the coordinator sent an unchanged final save plan, but this rank holds none")
        if self._trying is not None:
            self._sent, self._trying = self._trying, None
        self.plan = self._final
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return _piece(self.shards, index)


class ShardLoadPlanner(DefaultLoadPlanner):
    """DCP load planner for a ``{name: Shard}`` dict: reads every box from the saved chunks it overlaps."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        self.shards: dict[str, Shard] = state_dict
        self.state_dict = {}
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items = []
        for name, shard in self.shards.items():
            stored = self.metadata.state_dict_metadata.get(name)
            if not isinstance(stored, TensorStorageMetadata) or tuple(stored.size) != shard.shape:
                raise ValueError(f"checkpoint entry {name!r} is {stored}, this rank expects a tensor of full "
                                 f"shape {shard.shape}")
            items += read_items_for_chunks(name, stored, [_chunk(p) for p in shard.pieces])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _piece(self.shards, index)
