"""ZeRO-3 (Rajbhandari et al. 2020, §5.3; FSDP's ``FULL_SHARD``): each bucket's parameters gathered when used.

Between uses a rank holds only its range of every bucket (``Bucket.shard_data``, the fp32 master);
the full ``data`` buffer, into which the parameters are views, is all-gathered just before the
first module that needs it runs and freed after (its storage resized to zero)::

    forward of a stage (buckets in the order its modules run: embedding first)
        module pre-hook:   wait for my buckets' gathers;  start the next bucket's (prefetch)
        module post-hook:  a bucket whose every module has run is freed;  a gradient hook on my output
    backward (the same buckets, last first)
        output-gradient hook (before my module's backward): wait for my buckets; start the next's
        post-accumulate-grad hooks: a bucket whose every gradient has accumulated is freed
    after the action: whatever is still gathered is freed

``reshard_after_forward`` (FSDP2's name; ``--reshard-after-forward``, on by default) decides
what "freed" means with many microbatches: on, every forward and every backward of every
microbatch gathers its buckets again — 2m gathers of each bucket per step, the memory of one
or two gathered buckets at a time; off, a stage's buckets stay gathered from its first forward
of the step until its last backward — one gather per step, the stage's whole parameters held
through the step (as ZeRO-2 holds them, but only for that stage's part of the step).

A recomputed forward (in the backward) gathers through the same pre-hooks and frees nothing. An
expert bucket under ep > 1 is gathered from the d/ep replicas holding those experts (``shard_of``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from modelpar.schedules.action import Action, Kind
from modelpar.schedules.kinds import SPECS
from modelpar.training.buckets import Bucket, BufferMeter
from modelpar.training.compile import gather_units
from modelpar.training.dp_comm import DataParallelComm, Pending

__all__ = ["ParamGather"]

_BACKWARD = (Kind.B, Kind.I, Kind.W)


class ParamGather:
    """Gathers and frees the ZeRO-3 buckets of this rank's stage ``modules`` around their use."""

    def __init__(self, modules: Mapping[int, nn.Module], buckets: Sequence[Bucket], comm: DataParallelComm,
                 meter: BufferMeter, reshard_after_forward: bool = True,
                 shard_of: Callable[[Bucket], tuple[DataParallelComm, int]] | None = None,
                 compiled: bool = False) -> None:
        self.comm, self.meter, self.reshard = comm, meter, reshard_after_forward
        self.shard_of = shard_of or (lambda bucket: (comm, 0))  # an expert bucket's group (``GradSync.shard_of``)
        self.hooks: list[Any] = []  # handles of the module and parameter hooks (``close`` removes them)
        of_param = {id(p): b for b in buckets for p in b.params}
        self._needs: dict[int, list[Bucket]] = {}  # id(module) -> buckets of its own parameters
        self._users = {b.index: 0 for b in buckets}  # modules using the bucket in one forward
        self._order: dict[int, list[Bucket]] = {}  # stage -> its buckets in forward order
        self._position: dict[int, tuple[int, int]] = {}  # bucket index -> (stage, place in that order)
        for stage, module in modules.items():
            order: list[Bucket] = []
            for m in gather_units(module, compiled):  # with compiled blocks: each block whole
                needed = list({id(of_param[id(p)]): of_param[id(p)] for p in m.parameters()}.values())
                self._needs[id(m)] = needed
                for b in needed:
                    self._users[b.index] += 1
                order += [b for b in needed if b not in order]
                self.hooks.append(m.register_forward_pre_hook(self._pre_forward))
                self.hooks.append(m.register_forward_hook(self._post_forward))
            order += [b for b in buckets if b.stage == stage and b not in order]
            self._order[stage] = order
            self._position.update({b.index: (stage, i) for i, b in enumerate(order)})
        for b in buckets:
            for p in b.params:
                self.hooks.append(p.register_post_accumulate_grad_hook(self._accumulated(b)))
        self._gathered: dict[int, tuple[Bucket, Pending | None, torch.Tensor | None]] = {}  # in flight or done
        self._left: dict[int, int] = {}  # bucket index -> uses left in this forward
        self._done: dict[int, int] = {}  # bucket index -> gradients accumulated in this backward
        self._finished: set[int] = set()  # buckets this action is done with (never prefetched again in it)
        self.kind: Kind | None = None  # the action running (None: the dry run, or outside the pipeline)
        self.last = False  # it is the stage's last backward of the step
        self.gathers = 0  # since the last ``take_step``
        self.waited = 0.0  # seconds the compute waited for gathers, since the last ``take_step``

    # --- gathering ------------------------------------------------------------------------------
    def _prefetch(self, b: Bucket | None) -> None:
        if b is not None and b.index not in self._finished:
            self._gather(b)

    def _gather(self, b: Bucket) -> None:
        """Start the bucket's all-gather (nothing if it is gathered or on its way)."""
        if b.index in self._gathered:
            return
        assert b.shard_data is not None
        self.meter.acquire(b.data)
        shard = b.shard_data if b.shard_data.dtype == b.data.dtype else b.shard_data.to(b.data.dtype)
        comm, _ = self.shard_of(b)
        pending = comm.all_gather(b.data, shard) if comm.size > 1 else None
        if pending is None:
            b.data.copy_(shard)
        self._gathered[b.index] = (b, pending, shard)
        self._left[b.index] = self._users[b.index]
        self.gathers += 1

    def _wait(self, b: Bucket) -> None:
        """Gather the bucket now if nothing started it; wait until it is complete."""
        self._gather(b)
        _, pending, _ = self._gathered[b.index]
        if pending is not None:
            t0 = time.perf_counter()
            self.comm.wait(pending)
            self.waited += time.perf_counter() - t0
            self._gathered[b.index] = (b, None, None)

    def _free(self, b: Bucket) -> None:
        if b.index in self._gathered:
            self._wait(b)  # a collective may not lose its buffer in flight
            del self._gathered[b.index]
            self.meter.release(b.data)

    def _neighbour(self, b: Bucket, step: int) -> Bucket | None:
        stage, i = self._position[b.index]
        order = self._order[stage]
        return order[i + step] if 0 <= i + step < len(order) else None

    def _free_now(self) -> bool:
        """Free buckets as they finish: always when resharding, else only in the stage's last backward."""
        return self.reshard or (self._weight_grads() and self.last)

    def _weight_grads(self) -> bool:
        """The action running accumulates weight gradients (``kinds.SPECS``: B, or W of a split backward)."""
        return self.kind is not None and SPECS[self.kind].weight_grads

    def close(self) -> None:
        """Remove the hooks from the modules and parameters (as ``GradSync.close``)."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []

    # --- hooks ----------------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        needed = self._needs[id(module)]
        for b in needed:
            self._wait(b)
        if self.kind not in _BACKWARD:
            self._prefetch(self._neighbour(needed[-1], +1))

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.kind in _BACKWARD:  # a recomputed forward: the backward needs the parameters next
            return
        needed = self._needs[id(module)]
        for b in needed:
            self._left[b.index] = self._left.get(b.index, 0) - 1
            if self._left[b.index] <= 0:
                self._finished.add(b.index)
                if self.reshard:
                    self._free(b)
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._pre_backward(needed))

    def _pre_backward(self, needed: list[Bucket]) -> Any:
        def hook(grad: torch.Tensor) -> None:
            for b in needed:
                self._wait(b)
            self._prefetch(self._neighbour(needed[0], -1))  # last to first
        return hook

    def _accumulated(self, b: Bucket) -> Any:
        def hook(param: torch.Tensor) -> None:
            if self._weight_grads():
                self._done[b.index] = self._done.get(b.index, 0) + 1
                if self._done[b.index] == len(b.params):
                    self._finished.add(b.index)
                    if self._free_now():
                        self._free(b)
        return hook

    def action_hook(self, action: Action, last_backward: bool) -> Any:
        """PipelineRunner action hook: the first bucket's gather starts with the action; after it, the
        stage's buckets still gathered are freed (unless they stay for the step's next microbatches)."""
        return self._around(action, last_backward)

    @contextmanager
    def _around(self, action: Action, last_backward: bool) -> Iterator[None]:
        self.kind, self.last, self._done, self._finished = action.kind, last_backward, {}, set()
        order = self._order[action.stage]
        if order:
            self._gather(order[-1] if action.kind in _BACKWARD else order[0])
        try:
            yield
        finally:
            free = self._free_now()
            self.kind = None
        if free:
            for b in order:
                self._free(b)

    def release_all(self) -> None:
        """Free every gathered bucket (after the optimizer step changed the ranges; after an evaluation)."""
        for b, _, _ in list(self._gathered.values()):
            self._free(b)

    def take_step(self) -> tuple[int, float]:
        """(gathers, seconds waited for them) since the last call."""
        out, self.gathers, self.waited = (self.gathers, self.waited), 0, 0.0
        return out
