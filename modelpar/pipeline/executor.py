"""The one loop that runs a rank's action list: receive, compute, send — and time every action.

Scheduling is data (``Schedule``); this loop only dispatches it, like torch.distributed.pipelining's
``_PipelineScheduleRuntime`` and unlike Megatron's hand-written warm-up / steady / cool-down loops::

    F  s m : x = input microbatch (s = 0) | activation from stage s-1    → run → send to s+1
             (the last stage computes the loss instead of sending)
    B  s m : g = loss (s = last) | gradient from stage s+1               → backward → send to s-1
    I  s m : as B, but only the input gradient; the weight part is kept as a closure
    W  s m : run that closure

Neighbouring stages on the same device (interleaved with K = 1, V shapes) hand tensors over
in memory. Receives are posted ``lookahead`` actions ahead so transfers overlap compute.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from modelpar.pipeline.p2p import P2P, act_tag, grad_tag
from modelpar.pipeline.shapes import TensorSpec
from modelpar.pipeline.stage import PipelineStage
from modelpar.schedules.action import Action, Kind
from modelpar.schedules.schedule import Schedule

__all__ = ["StepRecord", "run_actions"]


@dataclass
class StepRecord:
    """What one rank did in one step."""

    events: list[tuple[Action, float, float]] = field(default_factory=list)  # (action, start, end), seconds
    losses: dict[int, torch.Tensor] = field(default_factory=dict)  # microbatch -> loss (last stage only)
    peak_held: int = 0  # most microbatch-chunks held at once, F until B or I (the simulator's count)
    peak_held_until_w: int = 0  # the same, counting a split backward as held until its W


@dataclass(frozen=True)
class _Recv:
    device: int  # the peer device
    tag: int
    spec: TensorSpec
    what: str


def _plan_receives(actions: Sequence[Action], schedule: Schedule, me: int,
                   specs: dict[tuple[int, int], TensorSpec], rows: Sequence[int]) -> list[_Recv | None]:
    """For each action: the receive it needs from another device, if any."""
    dev, last, m_count = schedule.stage_to_device, schedule.num_stages - 1, schedule.num_microbatches
    grad_kinds = (Kind.B, Kind.I)
    plan: list[_Recv | None] = []
    for a in actions:
        s, m = a.stage, a.microbatch
        if a.kind is Kind.F and s > 0 and dev[s - 1] != me:
            plan.append(_Recv(dev[s - 1], act_tag(s, m, m_count), specs[s - 1, rows[m]],
                              f"the activation of microbatch {m} from stage {s - 1} (for action {a})"))
        elif a.kind in grad_kinds and s < last and dev[s + 1] != me:
            plan.append(_Recv(dev[s + 1], grad_tag(s + 1, m, m_count), specs[s, rows[m]],
                              f"the gradient of microbatch {m} from stage {s + 1} (for action {a})"))
        else:
            plan.append(None)
    return plan


def run_actions(
    schedule: Schedule,
    stages: dict[int, PipelineStage],
    p2p: P2P,
    specs: dict[tuple[int, int], TensorSpec],
    rows: Sequence[int],
    inputs: Sequence[torch.Tensor] | None,
    targets: Sequence[torch.Tensor] | None,
    lookahead: int = 3,
) -> StepRecord:
    """Run this device's actions of ``schedule`` once; ``rows[m]`` is microbatch m's size."""
    return _Step(schedule, stages, p2p, rows, inputs, targets).run(specs, lookahead)


class _Step:
    """State of one step on one device: held tensors, posted receives, the record."""

    def __init__(self, schedule: Schedule, stages: dict[int, PipelineStage], p2p: P2P, rows: Sequence[int],
                 inputs: Sequence[torch.Tensor] | None, targets: Sequence[torch.Tensor] | None) -> None:
        self.schedule, self.stages, self.p2p = schedule, stages, p2p
        self.rows, self.inputs, self.targets = list(rows), inputs, targets
        self.scale = [n / sum(rows) for n in rows]  # each loss weighted by its share of the batch
        self.dev, self.me, self.last = schedule.stage_to_device, p2p.device, schedule.num_stages - 1
        self.local: dict[tuple[str, int, int], torch.Tensor | None] = {}
        self.rec = StepRecord()

    def run(self, specs: dict[tuple[int, int], TensorSpec], lookahead: int) -> StepRecord:
        actions = self.schedule.actions[self.me]
        plan = _plan_receives(actions, self.schedule, self.me, specs, self.rows)
        posted: dict[int, tuple] = {}
        nxt, rec = 0, self.rec
        for i, a in enumerate(actions):
            try:
                while nxt < len(actions) and (nxt <= i or len(posted) < lookahead):
                    r = plan[nxt]
                    if r is not None:
                        posted[nxt] = self.p2p.post_recv(*r.spec, r.device, r.tag)
                    nxt += 1
                r = plan[i]
                received = self.p2p.wait(posted.pop(i), r.device, r.what) if r is not None else None
                start, end = self._run_one(a, received)
            except Exception as err:
                for st in self.stages.values():
                    st.clear()
                err.add_note(f"while running action {a} on rank {self.p2p.rank} (pipeline device {self.me})")
                raise
            rec.events.append((a, start, end))
            rec.peak_held = max(rec.peak_held, sum(st.held_graphs for st in self.stages.values()))
            rec.peak_held_until_w = max(rec.peak_held_until_w, sum(st.held for st in self.stages.values()))
        return rec

    def _run_one(self, a: Action, received: torch.Tensor | None) -> tuple[float, float]:
        """Run one action; return when its compute started (input there) and ended (before sending)."""
        stage, s, m, kind, dev, me = self.stages[a.stage], a.stage, a.microbatch, a.kind, self.dev, self.me
        if kind is Kind.F:
            if s == 0:
                x = self.inputs[m]  # type: ignore[index]
            else:
                x = received if received is not None else self.local.pop(("act", s, m))
            start = time.perf_counter()
            y = stage.forward(m, x, self.targets[m] if s == self.last else None, self.scale[m])  # type: ignore[index]
            end = time.perf_counter()
            if s == self.last:
                self.rec.losses[m] = y
            elif dev[s + 1] == me:
                self.local["act", s + 1, m] = y
            else:
                self.p2p.send(y, dev[s + 1], act_tag(s + 1, m, len(self.rows)), f"the send of action {a}")
            return start, end
        if kind is Kind.W:
            start = time.perf_counter()
            stage.backward_weight(m)
            return start, time.perf_counter()
        g = None if s == self.last else received if received is not None else self.local.pop(("grad", s, m))
        start = time.perf_counter()
        gx = stage.backward(m, g) if kind is Kind.B else stage.backward_input(m, g)
        end = time.perf_counter()
        if s > 0 and dev[s - 1] == me:
            self.local["grad", s - 1, m] = gx
        elif s > 0:
            self.p2p.send(gx, dev[s - 1], grad_tag(s, m, len(self.rows)), f"the send of action {a}")
        return start, end
