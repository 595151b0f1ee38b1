"""The one loop that runs a device's lowered program: post, compute, send — and time every action.

Scheduling is data; this loop only walks the plan of the lowered program
(``modelpar.schedules.lower``), like torch.distributed.pipelining's ``_PipelineScheduleRuntime``
and unlike Megatron's hand-written warm-up / steady / cool-down loops::

    RECV  post the receive into its buffer (the program puts it as early as the message order allows)
    SEND  send the output just computed (the program puts it right after its producer)
    F s m : x = input microbatch (s = 0) | stage s-1's output (same device) | the receive
            → run; the last stage computes the loss
    B s m : g = loss (s = last) | stage s+1's gradient (same device) | the receive → backward
    I s m : as B, but only the input gradient; the weight part is kept as a closure
            (fused: the whole backward, when its W comes right after — torch's _merge_bw)
    W s m : run that closure (absorbed after a fused I: nothing, and no hooks)

Stages on the same device hand tensors over in memory. Action hooks wrap each compute action
(``PipelineRunner.register_action_hook``) as it runs: a fused I as the B it is. The two halves of
an overlapped F&B pair (DualPipe; the lowered program has them back to back, their sends after
both) run on two CUDA streams on a GPU and one after the other on a CPU (``pair_streams``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch

from modelpar.pipeline.bounded_comm import FlightRecorder
from modelpar.pipeline.p2p import P2P, Posted
from modelpar.pipeline.pair_streams import PairStreams
from modelpar.pipeline.program import COMPUTE, SEND, Planned
from modelpar.pipeline.stage import LocalStage
from modelpar.pipeline.timing import CudaTimer, HostTimer
from modelpar.schedules.action import Action, Kind

__all__ = ["ActionHook", "StepContext", "StepRecord", "run_plan"]

ActionHook = Callable[[Action, bool], "AbstractContextManager[Any] | None"]


@dataclass
class StepRecord:
    """What one rank did in one step."""

    events: list[tuple[Action, float, float]] = field(default_factory=list)  # (action, start, end), seconds
    losses: dict[int, torch.Tensor] = field(default_factory=dict)  # microbatch -> loss (last stage only)
    peak_held: int = 0  # most microbatch-chunks held at once, F until B or W (the simulator's count)


class StepContext:
    """What a step runs with: this device's stages, its messenger, its timer and the hooks."""

    def __init__(self, stages: dict[int, LocalStage], p2p: P2P | None, timer: HostTimer | CudaTimer,
                 recorder: FlightRecorder, hooks: Sequence[ActionHook], timeout: float,
                 streams: PairStreams | None = None) -> None:
        self.stages, self.p2p, self.timer, self.recorder = stages, p2p, timer, recorder
        self.hooks, self.timeout = hooks, timeout
        self.streams = streams if streams is not None else PairStreams(torch.device("cpu"))


def run_plan(ctx: StepContext, plan: Sequence[Planned], inputs: Sequence[torch.Tensor] | None,
             targets: Sequence[torch.Tensor] | None, scale: Sequence[float], for_backward: bool = True) -> StepRecord:
    """Run one step of a device's plan; ``scale[m]`` weighs microbatch m's loss (its share of the rows)."""
    return _Step(ctx, inputs, targets, scale, for_backward).run(plan)


class _Step:
    """One step on one device: the tensors between operations, and what was measured."""

    def __init__(self, ctx: StepContext, inputs: Sequence[torch.Tensor] | None,
                 targets: Sequence[torch.Tensor] | None, scale: Sequence[float], for_backward: bool) -> None:
        self.ctx, self.inputs, self.targets, self.scale = ctx, inputs, targets, scale
        self.for_backward = for_backward
        self.local: dict[Any, Any] = {}  # hand-overs between stages of this device
        self.inbox: dict[Any, Posted] = {}  # receives posted, not yet used
        self.outbox: dict[Any, torch.Tensor] = {}  # outputs computed, not yet sent
        self.marks: list[tuple[Action, Any, Any]] = []
        self.rec = StepRecord()

    def run(self, plan: Sequence[Planned]) -> StepRecord:
        ctx, p2p = self.ctx, self.ctx.p2p
        ctx.timer.start_step()
        p = None
        try:
            for p in plan:
                if p.code == COMPUTE:
                    self.compute(p)
                elif p.code == SEND:
                    p2p.send(self.outbox.pop(p.key), p.peer, p.key, p.what)  # type: ignore[union-attr, arg-type]
                else:
                    self.inbox[p.key] = p2p.post_recv(p.buffer, p.peer, p.key, p.what)  # type: ignore[union-attr, arg-type]
                ctx.recorder.issued(p.text)
            if p2p is not None:
                p2p.finish()
        except BaseException as err:  # KeyboardInterrupt too: leave nothing held
            for st in ctx.stages.values():
                st.clear()
            if p2p is not None:
                p2p.abandon()
            if p is not None:
                err.add_note(f"while running {p.text} on {ctx.recorder.where}")
            raise
        times = ctx.timer.resolve([t for _, s, e in self.marks for t in (s, e)], ctx.timeout, self.stuck)
        self.rec.events = [(a, times[2 * i], times[2 * i + 1]) for i, (a, _, _) in enumerate(self.marks)]
        return self.rec

    def compute(self, p: Planned) -> None:
        """Take the action's input, run it inside the hooks, put its output where it goes."""
        a, ctx = p.op, self.ctx
        assert isinstance(a, Action)
        stage = ctx.stages[a.stage]
        with ctx.streams.half(a, p.pair, p.partner):  # a pair's half on its stream: its receive waits there too
            x: Any = None
            if p.source == "input":
                x = self.inputs[a.microbatch]  # type: ignore[index]
            elif p.source == "local":
                x = self.local.pop(p.source_key)
            elif p.source == "recv":
                x = ctx.p2p.wait(self.inbox.pop(p.source_key))  # type: ignore[union-attr]
            if p.pair:
                ctx.streams.used(x)
            if ctx.hooks and not p.absorbed:
                seen = Action(a.stage, Kind.B, a.microbatch) if p.fused else a  # a fused I is a whole backward
                with ExitStack() as around:
                    for hook in ctx.hooks:
                        cm = hook(seen, p.final)
                        if cm is not None:
                            around.enter_context(cm)
                    start, y, end = self.timed(stage, a, x, p)
            else:
                start, y, end = self.timed(stage, a, x, p)
        if p.pair:
            ctx.streams.produced(y)
        if a.kind in (Kind.B, Kind.I):
            ctx.streams.forget(a.stage, a.microbatch)
        self.marks.append((a, start, end))
        if p.sink == "loss":
            self.rec.losses[a.microbatch] = y
        elif p.sink == "local":
            self.local[p.key] = y
        elif p.sink == "send":
            self.outbox[p.key] = y
        held = ctx.stages.values()
        self.rec.peak_held = max(self.rec.peak_held, sum(st.held for st in held))

    def timed(self, stage: LocalStage, a: Action, x: Any, p: Planned) -> tuple[Any, Any, Any]:
        """(start mark, result, end mark) of one action."""
        timer = self.ctx.timer
        start = timer.mark()
        y = self.call(stage, a, x, p)
        return start, y, timer.mark()

    def call(self, stage: LocalStage, a: Action, x: Any, p: Planned) -> Any:
        """A forward's output (the loss on the last stage), or a backward's input gradient."""
        m = a.microbatch
        if a.kind is Kind.F:
            target = self.targets[m] if stage.is_last else None  # type: ignore[index]
            return stage.forward(m, x, target, self.scale[m], self.for_backward)
        if p.absorbed:  # the fused I just before did this W's work
            return None
        if a.kind is Kind.B or p.fused:
            return stage.backward(m, x)
        if a.kind is Kind.I:
            return stage.backward_input(m, x)
        stage.backward_weight(m)
        return None

    def stuck(self) -> BaseException:
        """The error when the step's GPU work does not finish within the timeout."""
        p2p = self.ctx.p2p
        pending = p2p.unfinished() if p2p is not None else None
        what = f"the step's GPU work to finish (first unfinished: {pending or 'compute'})"
        return self.ctx.recorder.timeout(self.ctx.timeout, what)
