"""``PipelineRunner``: run any validated ``Schedule`` across the processes of a pipeline group.

Every rank of the group builds a runner with the same schedule and its own stages, then calls
``step`` with the same arguments structure: the first stage's rank passes the inputs, the last
stage's rank the targets (others may pass them too; they are ignored)::

    runner = PipelineRunner(get_schedule("1f1b", stages=4, microbatches=8), stages, F.mse_loss, group)
    losses = runner.step(x, y)       # grads accumulated for the whole batch
    optimizer.step(); optimizer.zero_grad()
    val = runner.evaluate(x, y)      # forward-only schedule, no_grad, eval mode: the batch's mean loss
    timeline = measured_timeline(runner)  # modelpar.pipeline.measure; collective: what every rank did

The schedule is lowered once (``modelpar.schedules.lower``): each rank walks its program of
compute actions, sends and receives, matched by order with its peers' — the same code on gloo
and NCCL. The batch is cut into M microbatches along dim 0 (``torch.tensor_split``: sizes differ
by at most one) and each microbatch loss is weighted by its share of the rows, so the accumulated
gradient is that of the whole batch's mean loss (reference §2.1). The optimizer step is yours.

``group`` is the pipeline process group (or a 1-D DeviceMesh); ``None`` runs a one-device
schedule in this process, with no communication.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from modelpar._validate import check_number
from modelpar.distributed.devices import check_stage_device
from modelpar.pipeline.bounded_comm import FlightRecorder, comm_device
from modelpar.pipeline.clock import clock_offset
from modelpar.pipeline.executor import ActionHook, StepContext, StepRecord, run_plan
from modelpar.pipeline.p2p import P2P
from modelpar.pipeline.pair_streams import PairStreams
from modelpar.pipeline.program import Planned, build_plan
from modelpar.pipeline.shapes import BatchSpec, TensorSpec, dry_run, exchange_batch, microbatch_sizes
from modelpar.pipeline.stage import LocalStage, LossFn
from modelpar.pipeline.timing import timer_for
from modelpar.schedules.derive import forward_only
from modelpar.schedules.lower import Transfer, lower
from modelpar.schedules.schedule import Schedule

__all__ = ["CHECK_MESSAGES_ENV", "PipelineRunner"]

CHECK_MESSAGES_ENV = "MODELPAR_CHECK_MESSAGES"  # "1": every runner checks message sequence numbers


class PipelineRunner:
    """Execute ``schedule`` on this rank's stages; one object per rank, all built alike."""

    def __init__(
        self,
        schedule: Schedule,
        stage_modules: Mapping[int, nn.Module],
        loss_fn: LossFn,
        group: Any,
        *,
        timeout: float = 60.0,
        check_messages: bool | None = None,
        merge_backward: bool = True,
    ) -> None:
        if not isinstance(schedule, Schedule):
            raise ValueError(f"schedule must be a modelpar Schedule, got {type(schedule).__name__}")
        if not callable(loss_fn):
            raise ValueError(f"loss_fn must be callable (output, target) -> scalar, got {loss_fn!r}")
        self.timeout = check_number("timeout", timeout, 0.0, strict=True)
        self.merge_backward = bool(merge_backward)  # an I right before its own W runs as one full backward
        self.programs = lower(schedule)  # validates; a schedule that would hang fails here, on every rank
        self.schedule = schedule
        self.group = group.get_group() if hasattr(group, "get_group") else group  # a 1-D DeviceMesh
        self.group_rank, rank = self._check_group(schedule)
        self._check_modules(stage_modules)
        last = schedule.num_stages - 1
        self.stages = {s: LocalStage(s, m, schedule.num_stages, loss_fn if s == last else None)
                       for s, m in sorted(stage_modules.items())}
        self.loss_fn = loss_fn
        self.recorder = FlightRecorder(rank, self.group_rank)
        compute_device = _device_of(stage_modules.values())
        if schedule.num_ranks > 1:  # sends and receives leave from the group's device
            for s, m in sorted(stage_modules.items()):
                if any(True for _ in (*m.parameters(), *m.buffers())):  # a stage without tensors computes anywhere
                    check_stage_device(_device_of([m]), comm_device(self.group), f"stage {s}'s parameters")
        if check_messages is None:
            check_messages = os.environ.get(CHECK_MESSAGES_ENV, "") not in ("", "0")
        self.p2p = (P2P(self.group, self.timeout, compute_device, self.recorder, check_messages)
                    if schedule.num_ranks > 1 else None)
        self.timer = timer_for(compute_device)
        self.streams = PairStreams(compute_device)  # the overlapped F&B pairs' (DualPipe-V)
        self._owners = (schedule.rank_of(0), schedule.rank_of(last))  # group ranks
        self._hooks: OrderedDict[int, ActionHook] = OrderedDict()  # a dict RemovableHandle can refer to weakly
        self._batch: BatchSpec | None = None
        self._specs: dict[tuple[int, int], TensorSpec] = {}
        self._plans: dict[str, list[Planned]] = {}  # "train" / "eval" -> plan for the learned batch shape
        self._clock: float | None = None  # offset of this rank's perf_counter to device 0's
        self._failed: str | None = None
        self.record = StepRecord()  # the last training step on this rank
        self.last_loss: torch.Tensor | None = None  # whole-batch mean loss (last stage's rank)

    def _check_group(self, schedule: Schedule) -> tuple[int, int]:
        """This rank's (group rank, global rank); ValueError unless the group fits the schedule."""
        if self.group is None:
            if schedule.num_ranks != 1:
                raise ValueError(f"group None runs a one-device schedule in this process, but schedule "
                                 f"{schedule.name!r} has {schedule.num_ranks} devices: pass the pipeline process group")
            return 0, dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("torch.distributed must be initialised before a PipelineRunner is built on a group "
                             "(init_process_group, or modelpar.distributed.launch / LocalCluster)")
        size = dist.get_world_size(self.group)
        if size != schedule.num_ranks:
            raise ValueError(f"schedule {schedule.name or ''!s} has {schedule.num_ranks} devices but the pipeline "
                             f"group has {size} processes; they must be equal")
        me = dist.get_rank(self.group)
        if me < 0:
            raise ValueError(f"rank {dist.get_rank()} is not a member of the pipeline group")
        return me, dist.get_rank()

    def _check_modules(self, stage_modules: Mapping[int, nn.Module]) -> None:
        want = self.schedule.stages_on(self.group_rank)
        if not isinstance(stage_modules, Mapping) or sorted(stage_modules) != want:
            got = sorted(stage_modules) if isinstance(stage_modules, Mapping) else type(stage_modules).__name__
            raise ValueError(
                f"stage_modules on pipeline device {self.group_rank} must map exactly its stages {want} "
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
        self._batch, self._plans = None, {}

    def register_action_hook(self, hook: ActionHook) -> RemovableHandle:
        """Call ``hook(action, last_backward)`` around every compute action of this rank; remove with
        the handle's ``remove()``.

        The hook returns a context manager (or None): its body is the action, so code before its
        ``yield`` runs when the action is about to run and code after when it has run.
        ``last_backward`` is True for the stage's last action of the step that adds to its weight
        gradients (its last B, or its last W with a split backward): after it the stage's gradients
        are final, e.g. to start their data-parallel all-reduce while the pipeline drains.
        """
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle

    def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Run the schedule once; return the per-microbatch losses (on the last stage's rank, else [])."""
        record, rows = self._run("train", inputs, targets)
        self.record = record
        if self.group_rank != self._owners[1]:
            self.last_loss = None
            return []
        losses = [record.losses[j] for j in range(len(rows))]
        self.last_loss = _weighted(losses, rows)
        return losses

    def evaluate(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> torch.Tensor | None:
        """The batch's mean loss through the forward-only schedule (no_grad, modules in eval mode).

        Same microbatches, lowered communication and loss weighting as ``step``; the loss on the
        last stage's rank, None elsewhere. Gradients and ``record`` are untouched.
        """
        modules = [m for st in self.stages.values() for m in st.module.modules()]
        modes = [m.training for m in modules]
        try:
            for m in modules:
                m.eval()
            with torch.no_grad():
                record, rows = self._run("eval", inputs, targets)
        finally:
            for m, training in zip(modules, modes):
                m.train(training)
        if self.group_rank != self._owners[1]:
            return None
        return _weighted([record.losses[j] for j in range(len(rows))], rows)

    def _run(self, mode: str, inputs: Any, targets: Any) -> tuple[StepRecord, list[int]]:
        if self._failed is not None:
            raise RuntimeError(
                f"a step of this PipelineRunner failed ({self._failed}); its messages may still be in flight on "
                "the group, so the runner runs no more steps: build a new process group and a new runner"
            )
        try:
            self._learn_shapes(inputs, targets)
        except ValueError:  # raised alike on every rank after the exchange: nothing is in flight
            self.reset_shapes()
            raise
        except BaseException as err:
            self._fail(err)
            raise
        try:
            (in_shape, in_dtype), (tg_shape, tg_dtype) = self._batch  # type: ignore[misc]
            m = self.schedule.num_microbatches
            first, last = (self.group_rank == owner for owner in self._owners)
            if first:
                _same("inputs", inputs, in_shape, in_dtype)
            if last:
                _same("targets", targets, tg_shape, tg_dtype)
            rows = microbatch_sizes(in_shape[0], m)
            xs = list(torch.tensor_split(inputs, m)) if first else None
            ys = list(torch.tensor_split(targets, m)) if last else None
            ctx = StepContext(self.stages, self.p2p, self.timer, self.recorder, list(self._hooks.values()),
                              self.timeout, self.streams)
            scale = [n / in_shape[0] for n in rows]
            record = run_plan(ctx, self._plan(mode), xs, ys, scale, for_backward=mode == "train")
        except BaseException as err:
            self._fail(err)
            raise
        offset = self._clock or 0.0
        record.events = [(a, s + offset, e + offset) for a, s, e in record.events]
        return record, rows

    def _learn_shapes(self, inputs: Any, targets: Any) -> None:
        """First step (or after ``reset_shapes``): batch exchange, dry run, clock, first messages."""
        if self._batch is not None:
            return
        m = self.schedule.num_microbatches
        batch = exchange_batch(inputs, targets, self._owners, m, self.group, self.timeout, self.recorder)
        modules = {s: st.module for s, st in self.stages.items()}
        self._specs = dry_run(modules, self.schedule.stage_to_rank, batch, m, self.loss_fn, self.group,
                              self.timeout, self.recorder)
        if self._clock is None:
            self._clock = clock_offset(self.group, self.timeout, self.recorder)
            if self.p2p is not None:
                dev = self.schedule.stage_to_rank
                self.p2p.connect(sorted({dev[op.peer_stage] for op in self.programs[self.group_rank]
                                         if isinstance(op, Transfer)}))
        self._batch, self._plans = batch, {}

    def _plan(self, mode: str) -> list[Planned]:
        """This rank's plan for ``mode``, built once per batch shape (its receive buffers reused)."""
        if mode not in self._plans:
            program = self.programs[self.group_rank]
            schedule = self.schedule
            if mode == "eval":
                schedule = forward_only(self.schedule)
                program = lower(schedule)[self.group_rank]
            assert self._batch is not None
            rows = microbatch_sizes(self._batch[0][0][0], schedule.num_microbatches)
            buffer_device = self.p2p.buffer_device if self.p2p is not None else torch.device("cpu")
            self._plans[mode] = build_plan(program, schedule, self.group_rank, self._specs, rows, buffer_device,
                                           merge_backward=self.merge_backward)
        return self._plans[mode]

    def _fail(self, err: BaseException) -> None:
        """After a failed step: refuse further steps on this runner (its messages may still be in flight)."""
        if self.p2p is None:
            return  # one device: nothing was in flight
        self._failed = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"

    # --- what measurement reads (modelpar.pipeline.measure) -----------------------------------
    @property
    def clock(self) -> float:
        """Offset of this rank's step clock (``timer``'s marks) to pipeline device 0's; 0 before the first step."""
        return self._clock or 0.0

    def output_specs(self, stage: int) -> list[TensorSpec]:
        """(shape, dtype) of ``stage``'s output for each microbatch of the learned batch; after a step."""
        if self._batch is None:
            raise ValueError("the batch shape is not known yet: run a step first")
        rows = microbatch_sizes(self._batch[0][0][0], self.schedule.num_microbatches)
        return [self._specs[stage, r] for r in rows]


def _weighted(losses: list[torch.Tensor], rows: list[int]) -> torch.Tensor:
    """The whole batch's mean loss from the microbatch means, each weighted by its share of the rows."""
    total = sum(rows)
    return sum(loss * (n / total) for loss, n in zip(losses, rows))  # type: ignore[return-value]


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
