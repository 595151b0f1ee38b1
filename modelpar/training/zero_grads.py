"""ZeRO-2 and ZeRO-3 gradients (Rajbhandari et al. 2020, §5.2): reduce-scattered every microbatch.

Each rank keeps only its range of every bucket's gradient (``Bucket.shard_grad``, 1/d of it).
The full ``grad`` buffer of a stage's buckets exists while one backward fills it::

    B of stage s:  each bucket, before its first gradient accumulates: acquire its buffer (zeros)
                   each bucket, as its last gradient accumulates: reduce-scatter (async) ──┐
                   after the backward: tp sums, the rest of s's buckets start             │
    next action:   ... computes while the reductions run ...                              │
                   then: shard_grad += my range; release the full buffer  ◄───────────────┘

Every backward (B, or W with a split backward) of every microbatch reduces its gradients —
ZeRO-2 has nowhere to accumulate the full gradient between microbatches, so the reduce-scatter
bytes are m times ZeRO-1's (``costmodel.dp_bytes_sent``). The tensor-parallel sums of partial
gradients run on the stage's full buffer after each backward (before its reduce-scatter); the
tied embedding's two copies are summed on the reduced ranges at the end of the step (both
copies are single-parameter buckets of one shape, so their ranges coincide). The mean over d,
the global norm and clipping work on the ranges, as under ZeRO-1. An expert bucket under ep > 1
is reduce-scattered over the d/ep replicas holding those experts (``GradSync.shard_of``) and
divided by d as the others (the ep ranks' tokens reached it through the backward all-to-all).

Under ZeRO-3 the full parameter buffers are gathered and freed by ``ParamGather``; with bf16
they hold bf16 copies of the fp32 master ranges (``shard_data``), and the gradients the backward
writes are bf16 too: each bucket is cast to fp32 before its reduce-scatter, so the reduction,
the accumulation over microbatches and AdamW are fp32 (FSDP2's ``reduce_dtype=float32``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from modelpar.schedules.action import Action
from modelpar.schedules.kinds import SPECS
from modelpar.training.buckets import Bucket, BufferMeter
from modelpar.training.dp_comm import Pending
from modelpar.training.grads import GradSync

__all__ = ["ShardedGradSync", "check_bucket_size"]


def check_bucket_size(buckets: list[Bucket], elements: int, shards: int, bucket_mb: float) -> None:
    """ValueError, the same on every rank (one MAX all-reduce over the world), if ``bucket_mb`` cannot
    hold one data-parallel shard of the largest parameter of any rank."""
    largest = max((p.numel() for b in buckets for p in b.params), default=0)
    need = torch.tensor([-(-largest // shards)], dtype=torch.float64, device=buckets[0].data.device)
    dist.all_reduce(need, op=dist.ReduceOp.MAX)
    if elements < need.item():
        raise ValueError(f"bucket_mb {bucket_mb:g} holds {elements} elements, fewer than one shard of the "
                         f"largest parameter ({int(need.item())} elements over d = {shards}); use bucket_mb "
                         f">= {need.item() * buckets[0].data.element_size() / 2**20:.4g}")


@dataclass
class ShardedGradSync(GradSync):
    """``GradSync`` for ZeRO-2/3 (``zero`` 2 or 3): every microbatch's gradients reduce-scattered into the ranges."""

    meter: BufferMeter | None = None  # counts the full buffers held (shared with ParamGather)
    compute_dtype: torch.dtype | None = None  # ZeRO-3: the gathered parameters' dtype (bf16 under bf16)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.meter = self.meter or BufferMeter()
        for b in self.buckets:
            lo, hi = self.shard_range(b)
            b.shard_grad = torch.zeros(hi - lo, dtype=b.grad.dtype, device=b.grad.device)
            if self.zero == 3:
                b.shard_data = b.data[lo:hi].clone()
                if self.compute_dtype is not None and self.compute_dtype != b.data.dtype:
                    _recast(b, self.compute_dtype)
                self.meter.release(b.data)
            self.meter.release(b.grad)
        self._stage_buckets = {s: [b for b in self.buckets if b.stage == s] for s in self.modules}
        self._filling: set[int] = set()  # buckets whose buffer this backward acquired
        self._accumulators = []  # each parameter's AccumulateGrad node, kept so that autograd reuses it
        for b in self.buckets:
            for p in b.params:
                view = p.view_as(p).grad_fn
                node = view.next_functions[0][0] if view is not None else None
                assert node is not None, "a parameter that needs no gradient cannot be in a bucket"
                self.hooks.append(node.register_prehook(self._before_accumulate(b)))
                self._accumulators.append(node)
        self._action = 0  # compute actions run this step
        self._inflight: list[tuple[Bucket, Pending | None, torch.Tensor, int]] = []  # (bucket, reduction, input, action)
        self.grad_views = [_holder(b.shard_grad) for b in self.buckets if b.shard_grad is not None]

    # --- during the step --------------------------------------------------------------------
    def zero_grad(self) -> None:
        for b in self.buckets:
            assert b.shard_grad is not None
            b.shard_grad.zero_()
        self._action = 0

    def action_hook(self, action: Action, last_backward: bool) -> Any:
        """PipelineRunner action hook (registered whether or not reductions overlap): a backward fills
        and reduces its stage's buckets; after any action, the reductions issued before it complete."""
        return self._around(action.stage, SPECS[action.kind].weight_grads)

    @contextmanager
    def _around(self, stage: int, backward: bool) -> Iterator[None]:
        self._action += 1
        mine = self._action
        if backward:
            self._complete(lambda b, w, n: b.stage == stage)  # the buffers are about to be reused
            self._armed, self._final, self._started, self._filling = stage, {}, set(), set()
        try:
            yield
        finally:
            self._armed = None
        if backward:
            self._stage_done(stage)  # tp sums, then every bucket not started yet
            if not self.overlap:
                self._complete(lambda b, w, n: True)
        self._complete(lambda b, w, n: n < mine)

    def _before_accumulate(self, bucket: Bucket) -> Any:
        """Pre-hook of a parameter's AccumulateGrad node: the bucket's buffer exists (zeros) before the
        backward adds its first gradient to it."""
        def hook(grad_outputs: Any) -> None:
            self._fill(bucket)
        return hook

    def _fill(self, bucket: Bucket) -> None:
        if bucket.index not in self._filling:
            assert self.meter is not None
            self._filling.add(bucket.index)
            self.meter.acquire(bucket.grad)
            bucket.grad.zero_()

    def _stage_done(self, stage: int) -> None:
        for b in self._stage_buckets[stage]:
            if b.ready == "stage" or b.index not in self._started:
                self._fill(b)  # a bucket no gradient reached: zeros (every rank issues the same collectives)
        self._sync_and_start(stage, self._stage_buckets[stage])

    def _start(self, bucket: Bucket) -> None:
        """Reduce-scatter the bucket's gradient (fp32) into its own range of the buffer."""
        self._started.add(bucket.index)
        grad = bucket.grad if bucket.grad.dtype == bucket.shard_grad.dtype else bucket.grad.to(bucket.shard_grad.dtype)  # type: ignore[union-attr]
        comm, _ = self.shard_of(bucket)
        lo, hi = self.shard_range(bucket)
        if comm.size == 1:  # experts held by one replica (d = ep): nothing to sum
            self._inflight.append((bucket, None, grad, self._action))
            self._complete(lambda b, w, n: b is bucket)
            return
        self._inflight.append((bucket, comm.reduce_scatter(grad, grad[lo:hi]), grad, self._action))
        self._complete(lambda b, w, n: w is not None and w.done.is_set())  # those already done: their buffers go now

    def _complete(self, which: Any) -> None:
        """Wait for the reductions ``which(bucket, pending, action)`` selects: add them into the ranges,
        free the buffers."""
        keep = []
        for bucket, pending, grad, n in self._inflight:
            if not which(bucket, pending, n):
                keep.append((bucket, pending, grad, n))
                continue
            if pending is not None:
                self.shard_of(bucket)[0].wait(pending)
            lo, hi = self.shard_range(bucket)
            assert bucket.shard_grad is not None and self.meter is not None
            bucket.shard_grad += grad[lo:hi]
            self.meter.release(bucket.grad)
        self._inflight = keep

    # --- after the step ---------------------------------------------------------------------
    def finish(self) -> None:
        """Wait for every reduction; sum the tied copies' ranges; the mean over d."""
        self._complete(lambda b, w, n: True)
        late = [b for b in self.buckets if b.ready == "step" and b.index not in self._expert_buckets]  # tied copies
        if len(late) == 2:  # p = 1, interleaved: both copies on this rank
            first, second = (b.shard_grad for b in late)
            assert first is not None and second is not None
            first += second
            second.copy_(first)
        elif late and self.embed_group is not None:
            dist.all_reduce(late[0].shard_grad, group=self.embed_group)
        for b in self.buckets:
            assert b.shard_grad is not None
            b.shard_grad.mul_(1.0 / self.comm.size)

    def grad_range(self, bucket: Bucket, start: int, stop: int) -> torch.Tensor:
        lo, _ = self.shard_range(bucket)
        assert bucket.shard_grad is not None
        return bucket.shard_grad[start - lo:stop - lo]

    # --- accounting -------------------------------------------------------------------------
    def gradient_bytes(self) -> int:
        """Bytes of the gradient ranges kept between steps (the full buffers come and go: ``meter``)."""
        return sum(b.shard_grad.numel() * b.shard_grad.element_size() for b in self.buckets
                   if b.shard_grad is not None)

    def parameter_bytes(self) -> int:
        """Bytes of the parameters kept between steps: the ranges under ZeRO-3, the full buffers under ZeRO-2."""
        if self.zero < 3:
            return super().parameter_bytes()
        return sum(b.shard_data.numel() * b.shard_data.element_size() for b in self.buckets
                   if b.shard_data is not None)

    @property
    def grad_holders(self) -> list[nn.Parameter]:
        return self.grad_views


def _holder(grad: torch.Tensor) -> nn.Parameter:
    """A stand-in parameter whose ``.grad`` is ``grad`` (what the non-finite check looks at)."""
    holder = nn.Parameter(grad, requires_grad=False)  # shares grad's storage: nothing allocated
    holder.grad = grad
    return holder


@torch.no_grad()
def _recast(bucket: Bucket, dtype: torch.dtype) -> None:
    """New full ``data`` and ``grad`` buffers in ``dtype`` (ZeRO-3 gathers bf16 copies); the views move to them."""
    bucket.data = torch.zeros(bucket.size, dtype=dtype, device=bucket.data.device)
    bucket.grad = torch.zeros(bucket.size, dtype=dtype, device=bucket.grad.device)
    for p, start in zip(bucket.params, bucket.offsets):
        p.data = bucket.data[start:start + p.numel()].view_as(p)
        p.grad = bucket.grad[start:start + p.numel()].view_as(p)
