"""A rank's parameters and gradients in flat buffers, cut into buckets: one data-parallel collective each.

    stage 3 (its params, last first)    stage 1                     tied copy
    [ bucket 0 | bucket 1 | tp sums ]   [ bucket 3 | bucket 4 ]     [ bucket 5 ]
       p.data = a view into bucket.data, p.grad = a view into bucket.grad (accumulated in place)

A bucket holds parameters of one stage only, so its gradients are final together: after that
stage's last backward of the step, and while it runs, as each of them accumulates for the last
time. ``ready`` says when the bucket may be reduced over the data-parallel group:

- ``"backward"``: as soon as its gradients are final (during or after the stage's last backward);
- ``"stage"``: after the stage's last backward *and* the tensor-parallel sum of its partial
  gradients (norms and row biases under sequence parallelism, replicated key/value heads);
- ``"step"``: after the whole pipeline step and the sum of a tied embedding's two copies over the
  embedding group (the other copy's stage runs on another rank, whose backward ends later).

The buffers hold ``numel`` elements padded to a multiple of ``shards`` (the data-parallel size
under ZeRO: each rank owns one equal contiguous range of every bucket). Under ZeRO-2 the rank
keeps its range of the gradient in ``shard_grad`` and the full ``grad`` buffer exists only while
a backward fills it and its reduction runs; under ZeRO-3 ``shard_data`` holds its range of the
parameters and the full ``data`` buffer exists only while gathered (``acquire``/``release``
resize the storage, so the parameters' views stay in place: FSDP1's flat-parameter trick). Buckets follow the
order the stages finish their backward, and within a stage the reverse order of its
parameters (the order the backward produces them), as torch DDP and Megatron order theirs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from modelpar.costmodel.inventory import bucket_groups

__all__ = ["READY", "Bucket", "BufferMeter", "build_buckets"]

READY = ("backward", "stage", "step")


@dataclass(eq=False)
class Bucket:
    """Parameters of one stage sharing flat ``data`` and ``grad`` buffers."""

    index: int  # position in the rank's bucket order (the order collectives are issued in)
    stage: int  # the (virtual) pipeline stage the parameters belong to
    ready: str  # one of READY
    params: list[nn.Parameter]
    offsets: list[int]  # where each parameter starts in the flat buffers
    numel: int  # elements of the parameters; the buffers are padded beyond it
    data: torch.Tensor  # [size]: the parameters' values
    grad: torch.Tensor  # [size]: their gradients
    shard_data: torch.Tensor | None = None  # ZeRO-3: this rank's range of data, the fp32 master (data is gathered)
    shard_grad: torch.Tensor | None = None  # ZeRO-2/3: this rank's range of the reduced gradient, accumulated

    @property
    def size(self) -> int:
        """Elements of the buffers: ``numel`` padded to a multiple of the shards."""
        return self.grad.numel()

    def shard_range(self, rank: int, shards: int) -> tuple[int, int]:
        """[start, stop) of the flat buffers that rank ``rank`` of ``shards`` owns."""
        per = self.size // shards
        return rank * per, (rank + 1) * per

    def owned_data(self, rank: int, shards: int) -> torch.Tensor:
        """This rank's range of the parameters: ``shard_data``, or a view into ``data``."""
        if self.shard_data is not None:
            return self.shard_data
        lo, hi = self.shard_range(rank, shards)
        return self.data[lo:hi]

    def owned_grad(self, rank: int, shards: int) -> torch.Tensor:
        """This rank's range of the gradient: ``shard_grad``, or a view into ``grad``."""
        if self.shard_grad is not None:
            return self.shard_grad
        lo, hi = self.shard_range(rank, shards)
        return self.grad[lo:hi]


class BufferMeter:
    """Full-size bucket buffers that come and go (ZeRO-2's gradients, ZeRO-3's gathered parameters):
    ``acquire`` gives a buffer its storage back, ``release`` frees it; bytes held now and at the peak."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self._counted: dict[int, int] = {}  # id(buffer) -> bytes, for the buffers acquired and not released

    @staticmethod
    def held(t: torch.Tensor) -> bool:
        return t.untyped_storage().size() > 0

    def acquire(self, t: torch.Tensor) -> None:
        if not self.held(t):
            t.untyped_storage().resize_(t.numel() * t.element_size())
        self.now = self.now - self._counted.pop(id(t), 0) + t.numel() * t.element_size()
        self._counted[id(t)] = t.numel() * t.element_size()
        self.peak = max(self.peak, self.now)

    def release(self, t: torch.Tensor) -> None:
        t.untyped_storage().resize_(0)
        self.now -= self._counted.pop(id(t), 0)

    def reset_peak(self) -> None:
        self.peak = self.now


def _split(params: Sequence[nn.Parameter], elements: int) -> list[list[nn.Parameter]]:
    """Consecutive groups of at most ``elements`` elements (a larger parameter alone): ``inventory.bucket_groups``."""
    return [[params[i] for i in g] for g in bucket_groups([p.numel() for p in params], elements)]


@torch.no_grad()
def _flatten(index: int, stage: int, ready: str, params: list[nn.Parameter], shards: int) -> Bucket:
    """Move ``params`` into new flat buffers: their data copied in, their ``.data`` and ``.grad`` views."""
    offsets, numel = [], 0
    for p in params:
        offsets.append(numel)
        numel += p.numel()
    size = math.ceil(numel / shards) * shards
    ref = params[0]
    data = torch.zeros(size, dtype=ref.dtype, device=ref.device)
    grad = torch.zeros(size, dtype=ref.dtype, device=ref.device)
    for p, start in zip(params, offsets):
        view = data[start:start + p.numel()].view_as(p)
        view.copy_(p.data)
        p.data = view
        p.grad = grad[start:start + p.numel()].view_as(p)
    return Bucket(index, stage, ready, params, offsets, numel, data, grad)


def build_buckets(stages: Sequence[tuple[int, nn.Module]], elements: int, shards: int = 1,
                  partial: Callable[[nn.Parameter], bool] = lambda p: False,
                  tied: Sequence[nn.Parameter] = ()) -> list[Bucket]:
    """Buckets of at most ``elements`` elements for ``stages`` ((stage, module) in the order their
    backward ends on this rank); every parameter moves into its bucket's buffers.

    ``partial(p)``: p's gradient is summed over the tensor-parallel group first (ready "stage");
    ``tied``: copies of a tied embedding (ready "step", one bucket each, after all others).
    """
    if elements < 1:
        raise ValueError(f"bucket elements must be >= 1, got {elements}")
    late = {id(p) for p in tied}
    buckets: list[Bucket] = []
    groups: list[tuple[int, str, list[nn.Parameter]]] = []
    for stage, module in stages:
        params = [p for p in reversed(list(module.parameters())) if id(p) not in late]
        groups += [(stage, "backward", g) for g in _split([p for p in params if not partial(p)], elements)]
        groups += [(stage, "stage", g) for g in _split([p for p in params if partial(p)], elements)]
    for stage, module in stages:
        groups += [(stage, "step", [p]) for p in module.parameters() if id(p) in late]
    for stage, ready, group in groups:
        buckets.append(_flatten(len(buckets), stage, ready, group, shards))
    return buckets
