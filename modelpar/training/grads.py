"""After (and during) the pipeline's backward: make every rank's gradients those of the single-process model.

Order (Megatron's ``finalize_model_grads``), per bucket of ``modelpar.training.buckets``:
1. tensor parallelism: sum the partial gradients over the tp group (norms and row biases under
   sequence parallelism, key/value heads replicated when t > kv heads);
2. tied embeddings split across stages: sum the first stage's embedding gradient and the last
   stage's head gradient over the embedding group (they are one weight in the model);
3. data parallelism: the mean over the dp group, one asynchronous collective per bucket — an
   all-reduce (``zero`` 0), or a reduce-scatter into the rank's range of the bucket (``zero`` 1,
   for ``ZeroAdamW``);
   Expert weights under expert parallelism (``ep`` > 1; docs/moe.md) instead: the sum over the
   d/ep replicas holding the same experts (``edp_group``), divided by d, after the step (a bucket
   of its own per expert tensor); under ZeRO a reduce-scatter into this rank's range of d/ep
   ranges, as Megatron's distributed optimizer shards expert state over the expert-data-parallel
   group (``shard_of`` says which group and index a bucket is sharded over);
4. clipping (``modelpar.training.clipping.GradClip``, over the gradients this leaves): the global
   L2 norm over all shards, in one scalar all-reduce.

With ``overlap`` step 3 starts during the pipeline step: a stage's last backward arms it
(``action_hook``, a ``PipelineRunner`` action hook), each bucket starts as soon as its last
gradient has accumulated, the rest when that backward ends (after step 1 for the stage), while
the pipeline's remaining work goes on; ``finish`` does step 2, starts the tied buckets and waits.
Without it ``finish`` does everything after the pipeline step.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from modelpar.model.moe import is_expert_param
from modelpar.schedules.action import Action
from modelpar.schedules.kinds import SPECS
from modelpar.schedules.schedule import Schedule
from modelpar.tensor_parallel import param_layout, sync_tensor_parallel_grads
from modelpar.training.buckets import Bucket, build_buckets
from modelpar.training.dp_comm import DataParallelComm, Pending

__all__ = ["GradSync", "finish_order"]


def finish_order(schedule: Schedule, device: int) -> list[int]:
    """The stages of pipeline ``device`` in the order their last backward (B, or W when split) runs."""
    last = {a.stage: i for i, a in enumerate(schedule.actions[device]) if SPECS[a.kind].weight_grads}
    return sorted(schedule.stages_on(device), key=lambda s: last.get(s, -1))


@dataclass
class GradSync:
    """The gradient work of one rank: its stage modules and where they sit in the (pp, dp, tp) grid."""

    modules: Mapping[int, nn.Module]  # this rank's stage modules by stage (v of them when interleaved)
    finish_order: Sequence[int]  # those stages in the order their backward ends in a step
    comm: DataParallelComm  # the dp group's collectives
    tp_group: Any  # None when t = 1
    embed_group: Any  # first and last stage of this (dp, tp) pipeline, when tied across stages
    tp_rank: int
    dp_rank: int
    tied_split: bool = False  # tied embeddings with the head on another stage (a separate copy)
    zero: int = 0  # 1: reduce-scatter into this rank's ranges (the ZeRO-1 optimizer's)
    bucket_elements: int = 1 << 22
    overlap: bool = True
    ep: int = 1  # expert-parallel ranks (folded into d)
    edp_group: Any = None  # the replicas holding this rank's experts (None: one)
    buckets: list[Bucket] = field(init=False)
    expert_comm: DataParallelComm = field(init=False)  # collectives over edp_group, counted with ``comm``'s

    @property
    def edp_rank(self) -> int:
        """This rank's index among the d/ep replicas holding its experts (``dp_index = edp_index · ep + ep_index``)."""
        return self.dp_rank // self.ep

    def shard_of(self, bucket: Bucket) -> tuple[DataParallelComm, int]:
        """The collectives over the ranks sharing ``bucket``'s parameters and this rank's index among them: the
        expert-data-parallel group for an expert bucket under ep > 1, the d (·cp) replicas for every other."""
        if bucket.index in self._expert_buckets:
            return self.expert_comm, self.edp_rank
        return self.comm, self.dp_rank

    def shard_range(self, bucket: Bucket) -> tuple[int, int]:
        """[start, stop) of ``bucket``'s flat buffers this rank owns under ZeRO (its range in ``shard_of``'s group)."""
        comm, rank = self.shard_of(bucket)
        return bucket.shard_range(rank, comm.size)

    def __post_init__(self) -> None:
        self.params = [p for s in sorted(self.modules) for p in self.modules[s].parameters()]
        self.tied: list[nn.Parameter] = []  # the tied weight's copies held here (embedding, head)
        self.tied_copy_ids: set[int] = set()  # the head's copy of a tied weight (counted once: the embedding's)
        for m in self.modules.values() if self.tied_split else ():
            embed, head = getattr(m, "embed", None), getattr(m, "head", None)
            if embed is not None:
                self.tied.append(embed.word.weight)
            if head is not None:
                self.tied.append(head.weight)
                self.tied_copy_ids.add(id(head.weight))
        experts = [p for p in self.params if is_expert_param(p)]
        self.expert_ids = {id(p) for p in experts}  # replicated over t; their layout is the ep split
        partial = (lambda p: param_layout(p).partial_grad) if self.tp_group is not None else (lambda p: False)
        self.buckets = build_buckets([(s, self.modules[s]) for s in self.finish_order], self.bucket_elements,
                                     self.comm.size if self.zero else 1, partial,
                                     self.tied + (experts if self.ep > 1 else []))
        self._expert_buckets = {b.index for b in self.buckets if self.ep > 1 and id(b.params[0]) in self.expert_ids}
        self.expert_comm = self.comm.on(self.edp_group)
        self._of_stage: dict[int, list[Bucket]] = {s: [b for b in self.buckets if b.stage == s and b.ready != "step"]
                                                   for s in self.modules}
        self._started: set[int] = set()  # buckets whose reduction started this step
        self._pending: list[tuple[Bucket, Pending]] = []  # and their collectives in flight
        self._armed: int | None = None  # the stage whose last backward is running
        self._final: dict[int, set[int]] = {}  # bucket index -> its parameters final so far (while armed)
        self.hooks: list[Any] = []  # handles of the hooks on the parameters and autograd nodes (``close``)
        if self.overlap:
            for b in self.buckets:
                if b.ready == "backward":
                    for p in b.params:
                        self.hooks.append(p.register_post_accumulate_grad_hook(self._accumulated(b)))

    def close(self) -> None:
        """Remove this object's hooks from the parameters: a hook holds this object, and through it the run's
        process groups, from the parameter's C++ side, where the garbage collector cannot see the cycle."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []

    # --- during the step --------------------------------------------------------------------
    def zero_grad(self) -> None:
        for b in self.buckets:
            b.grad.zero_()

    def action_hook(self, action: Action, last_backward: bool) -> Any:
        """PipelineRunner action hook: around a stage's last backward, its buckets start reducing."""
        return self._last_backward(action.stage) if last_backward and self.overlap else None

    @contextmanager
    def _last_backward(self, stage: int) -> Iterator[None]:
        self._armed, self._final = stage, {}
        try:
            yield
        finally:
            self._armed = None
        self._stage_done(stage)

    def _accumulated(self, bucket: Bucket) -> Any:
        """The post-accumulate-grad hook of ``bucket``'s parameters: during the stage's last backward,
        the parameter's gradient is final."""
        def hook(param: torch.Tensor) -> None:
            if self._armed == bucket.stage:
                self._final.setdefault(bucket.index, set()).add(id(param))
                self._start_ready(bucket.stage)
        return hook

    def _start_ready(self, stage: int) -> None:
        """Start the stage's buckets whose gradients are all final, in bucket order (the same on every rank)."""
        for b in self._of_stage[stage]:
            if b.index in self._started:
                continue
            if b.ready != "backward" or len(self._final.get(b.index, ())) < len(b.params):
                return
            self._start(b)

    def _stage_done(self, stage: int) -> None:
        """After the stage's last backward: its tensor-parallel sums, then every bucket of it not started yet."""
        self._sync_and_start(stage, self._of_stage[stage])

    def _sync_and_start(self, stage: int, buckets: list[Bucket]) -> None:
        """The stage's tensor-parallel sums (if a bucket waits for them), then each of ``buckets`` not started yet."""
        if self.tp_group is not None and any(b.ready == "stage" for b in buckets):
            sync_tensor_parallel_grads(self.modules[stage])
        for b in buckets:
            if b.index not in self._started:
                self._start(b)

    def _start(self, bucket: Bucket) -> None:
        """Start the bucket's data-parallel reduction (nothing to do when d = 1)."""
        self._started.add(bucket.index)
        comm, _ = self.shard_of(bucket)  # an expert bucket: its replicas sum, then the mean over d as any other
        owned = self.owned_grad(bucket)
        if comm.size > 1:
            reduce = comm.reduce_scatter(bucket.grad, owned) if self.zero else comm.all_reduce(owned)
            self._pending.append((bucket, reduce))
        elif self.comm.size > 1:  # experts held by one replica (d = ep): nothing to sum
            owned.mul_(1.0 / self.comm.size)

    # --- after the step ---------------------------------------------------------------------
    def finish(self) -> None:
        """Steps 1-3 for whatever has not started; wait for all: the gradients (under ZeRO-1 this
        rank's ranges of them) are the full model's mean-batch gradients."""
        for stage in self.finish_order:
            if any(b.index not in self._started for b in self._of_stage[stage]):
                self._stage_done(stage)
        if len(self.tied) == 2:  # p = 1, interleaved: both copies on this rank
            first, second = (w.grad for w in self.tied)
            assert first is not None and second is not None
            total = first + second
            first.copy_(total)
            second.copy_(total)
        elif self.tied and self.embed_group is not None:
            grad = self.tied[0].grad
            assert grad is not None
            dist.all_reduce(grad, group=self.embed_group)
        for b in self.buckets:
            if b.ready == "step":
                self._start(b)
        for bucket, pending in self._pending:
            self.shard_of(bucket)[0].wait(pending)
            self.owned_grad(bucket).mul_(1.0 / self.comm.size)
        self._started, self._pending = set(), []

    def owned_grad(self, bucket: Bucket) -> torch.Tensor:
        """The part of the bucket's gradient this rank reduced: all of it, or its range under ZeRO-1."""
        if not self.zero:
            return bucket.grad
        comm, rank = self.shard_of(bucket)
        return bucket.owned_grad(rank, comm.size)

    def grad_range(self, bucket: Bucket, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the bucket's gradient (positions in the full flat buffer)."""
        return bucket.grad[start:stop]

    # --- accounting -------------------------------------------------------------------------
    def gradient_bytes(self) -> int:
        """Bytes of this rank's gradient buffers (kept between steps)."""
        return sum(b.grad.numel() * b.grad.element_size() for b in self.buckets)

    def parameter_bytes(self) -> int:
        """Bytes of this rank's parameter buffers (kept between steps)."""
        return sum(b.data.numel() * b.data.element_size() for b in self.buckets)

    @property
    def grad_holders(self) -> list[nn.Parameter]:
        """Tensors whose ``.grad`` are this rank's reduced gradients (for the non-finite check)."""
        return self.params
