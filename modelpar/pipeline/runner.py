"""``PipelineRunner``: run any validated ``Schedule`` across the processes of a pipeline group.

Every rank of the group builds a runner with the same schedule and its own stages, then calls
``step`` with the same arguments structure: the first stage's rank passes the inputs, the last
stage's rank the targets (others may pass them too; they are ignored)::

    runner = PipelineRunner(get_schedule("1f1b", stages=4, microbatches=8), split_stages(model, schedule), F.mse_loss)
    losses = runner.step(x, y)       # grads accumulated for the whole batch
    optimizer.step(); optimizer.zero_grad()
    timeline = runner.timeline()     # collective: what every rank did, for the renderers

The batch is cut into M microbatches along dim 0 (``torch.tensor_split``: sizes differ by at
most one) and each microbatch loss is weighted by its share of the rows, so the accumulated
gradient is that of the whole batch's mean loss (reference §2.1). The optimizer step is yours.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from modelpar._validate import check_int, check_number
from modelpar.pipeline.clock import clock_offset
from modelpar.pipeline.executor import StepRecord, run_actions
from modelpar.pipeline.p2p import P2P, matches_by_tag
from modelpar.pipeline.shapes import BatchSpec, dry_run, exchange_batch, microbatch_sizes
from modelpar.pipeline.stage import LossFn, PipelineStage
from modelpar.schedules.schedule import Schedule

__all__ = ["PipelineRunner"]


class PipelineRunner:
    """Execute ``schedule`` on this rank's stages; one object per rank, all built alike."""

    def __init__(
        self,
        schedule: Schedule,
        stage_modules: Mapping[int, nn.Module],
        loss_fn: LossFn,
        group: Any = None,
        *,
        timeout: float = 60.0,
        lookahead: int = 3,
    ) -> None:
        if not isinstance(schedule, Schedule):
            raise ValueError(f"schedule must be a modelpar Schedule, got {type(schedule).__name__}")
        self.schedule = schedule.validate()
        if not callable(loss_fn):
            raise ValueError(f"loss_fn must be callable (output, target) -> scalar, got {loss_fn!r}")
        self.timeout = check_number("timeout", timeout, 0.0, strict=True)
        self.lookahead = check_int("lookahead", lookahead, minimum=1)
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("torch.distributed must be initialised before a PipelineRunner is built "
                             "(init_process_group, or modelpar.distributed.launch / LocalCluster)")
        self.group = group if group is not None else dist.group.WORLD
        size = dist.get_world_size(self.group)
        if size != schedule.num_devices:
            raise ValueError(
                f"schedule {schedule.name or ''!s} has {schedule.num_devices} devices but the pipeline "
                f"group has {size} processes; they must be equal"
            )
        self.device = dist.get_rank(self.group)
        if self.device < 0:
            raise ValueError(f"rank {dist.get_rank()} is not a member of the pipeline group")
        self._check_modules(stage_modules)
        if not matches_by_tag(self.group):
            raise ValueError(
                "the pipeline group must use gloo (tags match messages; NCCL ignores tags and orders "
                "point-to-point operations per communicator, which receives posted ahead can deadlock): "
                "give the pp dimension a gloo group, e.g. ParallelDims.build_mesh('cuda', "
                "pipeline_backend='gloo'); activations are then staged through host memory"
            )
        last = schedule.num_stages - 1
        self.stages = {s: PipelineStage(s, m, schedule.num_stages, loss_fn if s == last else None)
                       for s, m in sorted(stage_modules.items())}
        self.loss_fn = loss_fn
        self.p2p = P2P(self.group, self.timeout, compute_device=_device_of(stage_modules.values()))
        ranks = self.p2p.ranks
        self._owners = (ranks[schedule.device_of(0)], ranks[schedule.device_of(last)])
        self._batch: BatchSpec | None = None
        self._specs: dict[tuple[int, int], Any] = {}
        self.record = StepRecord()  # the last step on this rank
        self.last_loss: torch.Tensor | None = None  # whole-batch mean loss (last stage's rank)
        self._clock: float | None = None  # offset of this rank's perf_counter to device 0's

    def _check_modules(self, stage_modules: Mapping[int, nn.Module]) -> None:
        want = self.schedule.stages_on(self.device)
        if not isinstance(stage_modules, Mapping) or sorted(stage_modules) != want:
            got = sorted(stage_modules) if isinstance(stage_modules, Mapping) else type(stage_modules).__name__
            raise ValueError(
                f"stage_modules on pipeline device {self.device} must map exactly its stages {want} "
                f"to modules, got keys {got}"
            )
        for s, m in stage_modules.items():
            if not isinstance(m, nn.Module):
                raise ValueError(f"stage_modules[{s}] must be an nn.Module, got {type(m).__name__}")

    # --- running ---------------------------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        """The parameters of every stage on this rank (what its optimizer updates)."""
        return [p for st in self.stages.values() for p in st.module.parameters()]

    def reset_shapes(self) -> None:
        """Forget the batch shape: the next ``step`` learns it again (call on every rank)."""
        self._batch = None

    def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Run the schedule once; return the per-microbatch losses (on the last stage's rank, else [])."""
        me = dist.get_rank()
        first_owner, last_owner = self._owners
        if self._batch is None:
            self._batch = exchange_batch(inputs, targets, self._owners, self.schedule.num_microbatches, self.group)
            modules = {s: st.module for s, st in self.stages.items()}
            self._specs = dry_run(modules, self.schedule.stage_to_device, self._batch,
                                  self.schedule.num_microbatches, self.loss_fn, self.group)
            if self._clock is None:
                self._clock = clock_offset(self.group)
        (in_shape, in_dtype), (tg_shape, tg_dtype) = self._batch
        if me == first_owner:
            _same("inputs", inputs, in_shape, in_dtype)
        if me == last_owner:
            _same("targets", targets, tg_shape, tg_dtype)
        m = self.schedule.num_microbatches
        rows = microbatch_sizes(in_shape[0], m)
        xs = list(torch.tensor_split(inputs, m)) if me == first_owner else None  # type: ignore[arg-type]
        ys = list(torch.tensor_split(targets, m)) if me == last_owner else None  # type: ignore[arg-type]
        record = run_actions(self.schedule, self.stages, self.p2p, self._specs, rows, xs, ys, self.lookahead)
        self.p2p.finish()
        record.events = [(a, s + self._clock, e + self._clock) for a, s, e in record.events]
        self.record = record
        if me != last_owner:
            self.last_loss = None
            return []
        losses = [record.losses[j] for j in range(m)]
        self.last_loss = sum(loss * (n / in_shape[0]) for loss, n in zip(losses, rows))  # type: ignore[assignment]
        return losses

    def timeline(self) -> Any:
        """Collective over the group: every rank's measured events of the last step, as a Timeline."""
        from modelpar.pipeline.measure import gather_timeline

        return gather_timeline(self.record.events, self.schedule, self.group)


def _same(name: str, value: Any, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape or value.dtype != dtype:
        got = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"{name} must keep the shape and dtype of the first step, {shape} {dtype}, got {got}; "
            "call reset_shapes() on every rank before a step with a new batch shape"
        )


def _device_of(modules: Any) -> torch.device:
    """The device of the stages' first parameter or buffer (where received activations must go)."""
    for module in modules:
        for t in (*module.parameters(), *module.buffers()):
            return t.device
    return torch.device("cpu")
