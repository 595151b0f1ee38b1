"""ZeRO-1 (Rajbhandari et al. 2020, §5.1; Megatron's distributed optimizer): AdamW state sharded over d.

(Also the optimizer of ZeRO-2 and ZeRO-3: the ranges are then the buckets' ``shard_grad`` and, under
ZeRO-3, ``shard_data``; ZeRO-3 gathers no parameters after the step, its next forward does.)

Every bucket's flat buffers (``modelpar.training.buckets``, padded to a multiple of d) are cut
into d equal contiguous ranges, and data-parallel rank r owns range r of every bucket (an expert
bucket under ep > 1: into d/ep ranges over the replicas holding those experts, ``shard_of``)::

    bucket.grad  [ g g g g g | g g g g g ]   reduce-scatter: rank r gets the sum of its range
                    rank 0       rank 1
    AdamW        exp_avg, exp_avg_sq of its range only: 1/d of the state; it updates its range
    bucket.data  [ w w w w w | w w w w w ]   all-gather: every rank gets every updated range

A range cuts parameters anywhere. Each overlap of a parameter with this rank's range is a
*segment*: a 1-D view of the parameter's flat data (and of its gradient), and torch's AdamW
steps the segments — the same element-wise arithmetic as on whole parameters, so ZeRO-1 gives
ZeRO-0's parameters up to the rounding of the reduction. In a checkpoint a segment is the set of
boxes of the full (single-process) tensor it covers (``segment_shard``), so the optimizer state
reshards on load like everything else.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modelpar.checkpoint import Piece, Shard
from modelpar.tensor_parallel.sharding import ParamLayout
from modelpar.training.buckets import Bucket
from modelpar.training.dp_comm import DataParallelComm, Pending

__all__ = ["Segment", "ZeroAdamW", "flat_boxes", "segment_shard"]


@dataclass(eq=False)
class Segment:
    """Elements [start, stop) of ``param``'s flattened data that this rank updates."""

    param: nn.Parameter
    start: int
    stop: int
    data: torch.Tensor  # 1-D view of those elements in the rank's range of the bucket; its .grad the gradient's


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Boxes (offsets, sizes, flat start) covering elements [start, stop) of a row-major ``shape``.

    Each box is contiguous in memory. A range of a matrix is at most three: the rest of a first
    row, whole rows, the start of a last row; a k-dimensional tensor needs at most 2k − 1.
    """
    shape = tuple(shape)
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,), start)] if shape else [((), (), 0)]
    inner = math.prod(shape[1:])
    first, last = divmod(start, inner), divmod(stop, inner)
    boxes = []
    if first[1]:  # a partial first row
        end = min(stop, (first[0] + 1) * inner)
        boxes += [((first[0], *o), (1, *s), first[0] * inner + f)
                  for o, s, f in flat_boxes(shape[1:], first[1], end - first[0] * inner)]
        start = end
    rows = (math.ceil(start / inner), last[0])
    if rows[0] < rows[1]:
        boxes.append(((rows[0], *(0,) * (len(shape) - 1)), (rows[1] - rows[0], *shape[1:]), rows[0] * inner))
    if last[1] and last[0] * inner >= start:  # a partial last row
        boxes += [((last[0], *o), (1, *s), last[0] * inner + f) for o, s, f in flat_boxes(shape[1:], 0, last[1])]
    return boxes


def segment_shard(values: torch.Tensor, shape: Sequence[int], start: int, stop: int, layout: ParamLayout) -> Shard:
    """``values`` (elements [start, stop) of a flattened tensor-parallel part of ``shape`` with
    ``layout``, e.g. a segment's exp_avg) as boxes of the full single-process tensor."""
    full = layout.full_shape(shape)
    pieces = []
    for offsets, sizes, flat in flat_boxes(shape, start, stop):
        view = values[flat - start: flat - start + math.prod(sizes)].view(sizes)
        if layout.dim is None or layout.shards == 1:
            pieces.append(Piece(offsets, view))
            continue
        d = layout.dim
        for local, global_start, length in layout.pieces(full[d]):  # one per fused block
            lo, hi = max(offsets[d], local), min(offsets[d] + sizes[d], local + length)
            if lo < hi:
                moved = (*offsets[:d], global_start + lo - local, *offsets[d + 1:])
                pieces.append(Piece(moved, view.narrow(d, lo - offsets[d], hi - lo)))
    return Shard(full, pieces)


class ZeroAdamW:
    """AdamW over this data-parallel rank's range of every bucket; ``step`` then all-gathers the parameters.

    The gradients must already be reduce-scattered into the ranges (``GradSync``). Weight decay
    follows ``param_groups``' rule (matrices only), read from each segment's parameter.
    """

    def __init__(self, buckets: Sequence[Bucket], comm: DataParallelComm, dp_rank: int, weight_decay: float,
                 gather: bool = True, shard_of: Callable[[Bucket], tuple[DataParallelComm, int]] | None = None,
                 **adamw: Any) -> None:
        self.buckets, self.comm, self.dp_rank, self.gather = list(buckets), comm, dp_rank, gather
        self.shard_of = shard_of or (lambda bucket: (comm, dp_rank))  # an expert bucket's group (``GradSync.shard_of``)
        self.segments: list[Segment] = []
        for bucket in self.buckets:
            group, rank = self.shard_of(bucket)
            lo, hi = bucket.shard_range(rank, group.size)
            data, grad = bucket.owned_data(rank, group.size), bucket.owned_grad(rank, group.size)
            for p, offset in zip(bucket.params, bucket.offsets):
                a, b = max(lo, offset), min(hi, offset + p.numel())
                if a < b:
                    view = data[a - lo:b - lo]
                    view.grad = grad[a - lo:b - lo]
                    self.segments.append(Segment(p, a - offset, b - offset, view))
        decay = [s.data for s in self.segments if s.param.dim() >= 2]
        rest = [s.data for s in self.segments if s.param.dim() < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                            {"params": rest, "weight_decay": 0.0}], **adamw)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def step(self) -> None:
        """Update this rank's ranges, then all-gather every bucket's parameters (not under ZeRO-3)."""
        self.optimizer.step()
        pending: list[Pending] = []
        for bucket in self.buckets if self.gather else ():
            group, rank = self.shard_of(bucket)
            if group.size > 1:
                lo, hi = bucket.shard_range(rank, group.size)
                pending.append(group.all_gather(bucket.data, bucket.data[lo:hi]))
        for p in pending:
            self.comm.wait(p)

    def checkpoint_shards(self, names: dict[int, tuple[str, ParamLayout]]) -> Iterator[tuple[str, Shard]]:
        """(``optim.<name>.<field>``, this rank's boxes of it) for each segment's AdamW state, and under
        ZeRO-3 (``model.<name>``, its boxes of the parameter); ``names`` maps id(parameter) to its
        single-process name and layout."""
        for s in self.segments:
            name, layout = names[id(s.param)]
            if not self.gather:
                yield f"model.{name}", segment_shard(s.data, s.param.shape, s.start, s.stop, layout)
            for field, value in self.optimizer.state.get(s.data, {}).items():
                if field == "step":
                    yield f"optim.{name}.{field}", Shard.whole(value)
                else:
                    yield f"optim.{name}.{field}", segment_shard(value, s.param.shape, s.start, s.stop, layout)
