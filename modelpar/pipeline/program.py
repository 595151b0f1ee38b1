"""One device's lowered program resolved, once per batch shape, into what each operation needs.

The runner builds it after the dry run and caches it: each send and receive gets its peer (a
group rank) and its description; each receive gets a buffer, allocated once and reused by every
step; each compute action knows where its input comes from (the batch, a stage on this device, a
receive, or nothing) and where its output goes (the loss, a stage on this device, a send).
Messages and hand-overs are keyed alike: ``("F", s, m)`` is stage s's output for microbatch m,
``("B", s, m)`` the input gradient stage s sends back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from modelpar.pipeline.shapes import TensorSpec
from modelpar.schedules.action import Action, Kind
from modelpar.schedules.kinds import SPECS, describe_message, inputs_of
from modelpar.schedules.lower import Op, Transfer
from modelpar.schedules.schedule import Schedule

__all__ = ["COMPUTE", "RECV", "SEND", "Planned", "build_plan"]

COMPUTE, SEND, RECV = 0, 1, 2
Key = tuple[str, int, int]


@dataclass
class Planned:
    """One operation of the program, ready to run."""

    op: Op
    code: int  # COMPUTE, SEND or RECV
    text: str  # ``1RECV_F3``: what the flight recorder keeps
    what: str = ""  # the message, in words, for errors
    peer: int = -1  # group rank at the other end (SEND, RECV)
    key: Key | None = None  # the message (SEND, RECV), or the compute action's output
    source: str = ""  # COMPUTE: "input", "local", "recv" or "" (none: W, the last stage's backward)
    source_key: Key | None = None
    sink: str = ""  # COMPUTE: "loss", "local", "send" or ""
    buffer: torch.Tensor | None = None  # RECV: filled by every step
    final: bool = False  # COMPUTE: the stage's last weight-gradient action of the step
    fused: bool = False  # COMPUTE, an I: runs the whole backward (its W comes right after and is absorbed)
    absorbed: bool = False  # COMPUTE, a W: its work was done by the fused I just before it
    pair: int = 0  # COMPUTE: 1 the forward of an overlapped F&B pair, 2 its backward (run together), 0 alone
    partner: tuple[int, int] | None = None  # COMPUTE, a pair's forward: (stage, microbatch) of its backward


def build_plan(program: Sequence[Op], schedule: Schedule, me: int, specs: dict[tuple[int, int], TensorSpec],
               rows: Sequence[int], buffer_device: torch.device, merge_backward: bool = False) -> list[Planned]:
    """The plan of device ``me``'s ``program``; ``specs[stage, rows]`` is what stage sends for that many rows.

    ``merge_backward``: an I immediately followed by its own W (nothing between them in the
    program, so no send waits on the I alone) runs as one full backward, as torch's ``_merge_bw``
    does — one autograd call instead of two; the W is kept in the plan, absorbed, so the measured
    timeline still has the schedule's actions (the I taking the whole backward, the W about no
    time). Action hooks see what runs: the fused I as a B (it writes the weight gradients, and is
    the stage's last backward where its W was), the absorbed W not at all. (Seeing an I there, the
    ZeRO-2/3 hooks took it for an input gradient that writes no weight gradient, so a bucket they
    had freed after the previous backward received the gradients: a write into freed storage.)
    """
    dev, last = schedule.stage_to_rank, schedule.num_stages - 1
    final = {}
    for i, op in enumerate(program):
        if isinstance(op, Action) and SPECS[op.kind].weight_grads:
            final[op.stage] = i
    acts = schedule.actions[me]
    pairs = {acts[i]: acts[i + 1] for i in schedule.overlapped[me]}
    seconds = set(pairs.values())
    plan: list[Planned] = []
    for i, op in enumerate(program):
        if isinstance(op, Transfer):
            key = op.message
            what = f"{op} ({describe_message(key)})"
            peer = dev[op.peer_stage]
            if op.is_send:
                plan.append(Planned(op, SEND, str(op), what, peer, key))
            else:
                # what crosses a boundary has the shape of the lower stage's output (activation or its gradient)
                spec = specs[min(key[1], op.stage), rows[op.microbatch]]
                buffer = torch.empty(spec[0], dtype=spec[1], device=buffer_device)
                plan.append(Planned(op, RECV, str(op), what, peer, key, buffer=buffer))
            continue
        s, m = op.stage, op.microbatch
        p = Planned(op, COMPUTE, str(op), final=final.get(s) == i)
        if op in pairs:
            p.pair, p.partner = 1, (pairs[op].stage, pairs[op].microbatch)
        elif op in seconds:
            p.pair = 2
        if merge_backward and op.kind is Kind.I and i + 1 < len(program) and program[i + 1] == Action(s, Kind.W, m):
            p.fused, p.final = True, final.get(s) == i + 1  # it makes the weight gradients: the W's place
        elif plan and plan[-1].fused and op.kind is Kind.W:
            p.absorbed, p.final = True, False  # no work here: no hooks either
        for v in SPECS[op.kind].produces:  # what leaves the stage (at most one value does)
            if v.consumer:
                t = s + v.consumer
                p.key = (v.message, s, m)
                p.sink = v.boundary_out if not 0 <= t <= last else "local" if dev[t] == me else "send"
        for v, t in inputs_of(op.kind, s):  # what comes from another stage (at most one value does)
            if v.consumer:
                if not 0 <= t <= last:
                    p.source = v.boundary_in
                else:
                    p.source_key = (v.message, t, m)
                    p.source = "local" if dev[t] == me else "recv"
        plan.append(p)
    return plan
