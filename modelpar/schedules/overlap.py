"""DualPipe's overlapped F&B pair: which two actions may pair, how a pair is written, what it costs (pure Python).

A pair is two consecutive actions on one rank, a forward then a backward through the input (which
half a kind may be is ``kinds.SPECS``' ``half``), of which neither consumes what the other
produces: the runtime runs them together (on a GPU on two streams, each half's communication
behind the other half's compute; on a CPU one after the other) and the simulator prices them as

    pair time = max(c_F + c_B, x_F + x_B, c_F + x_F, c_B + x_B)

where c is a half's compute and x its communication inside the action (a MoE layer's all-to-alls):
the compute of both halves shares the rank, the communication of both shares the links, and
each half's communication waits on its own compute — but not on the other half's (DeepSeek-V3
technical report, 2024, §3.2.1 and Figure 4: "overlap the computation and communication within
a pair of individual forward and backward chunks"). Without communication it is c_F + c_B, the
two run back to back. In a schedule (``pair_span``) the forward starts when its input is in and
runs alone until the backward's is; only the rest of it overlaps (none when the backward's input
comes after the forward would have ended). Timed so, a pair never ends later — and its forward
never hands its output on later — than the two back to back, and without communication exactly then.

Written as torch.distributed.pipelining writes it: ``(0F3;7I1)OVERLAP_F_B``.
"""

from __future__ import annotations

import re

from modelpar.schedules.action import Action
from modelpar.schedules.kinds import SPECS

__all__ = ["OVERLAP_SUFFIX", "can_pair", "format_pair", "pair_span", "pair_time", "parse_pair"]

OVERLAP_SUFFIX = "OVERLAP_F_B"
_PAIR_RE = re.compile(rf"^\(([^;()]+);([^;()]+)\){OVERLAP_SUFFIX}$")


def can_pair(first: Action, second: Action) -> bool:
    """True when ``first`` may be the forward half of an overlapped pair and ``second`` its backward half."""
    return SPECS[first.kind].half == 1 and SPECS[second.kind].half == 2


def format_pair(first: Action, second: Action) -> str:
    """``(0F3;7I1)OVERLAP_F_B``."""
    return f"({first};{second}){OVERLAP_SUFFIX}"


def parse_pair(text: str) -> tuple[Action, Action] | None:
    """The two actions of ``(0F3;7I1)OVERLAP_F_B``; None when ``text`` is no pair."""
    match = _PAIR_RE.match(text.strip())
    if match is None:
        return None
    return Action.parse(match[1]), Action.parse(match[2])


def pair_time(first: float, first_comm: float, second: float, second_comm: float) -> float:
    """How long an overlapped pair takes: each half's time and the part of it that is communication."""
    first_comm, second_comm = min(first_comm, first), min(second_comm, second)  # communication is part of the time
    c1, c2 = first - first_comm, second - second_comm
    return max(c1 + c2, first_comm + second_comm, first, second)


def pair_span(ready_f: float, time_f: float, comm_f: float, ready_b: float, time_b: float,
              comm_b: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """(start, end) of a pair's forward and of its backward: the forward from ``ready_f`` (the rank free, its
    input in), the backward's input in at ``ready_b``; drawn one after the other, the overlapped part's time
    split between them in proportion to their own."""
    alone = min(max(0.0, ready_b - ready_f), time_f)  # the forward's part before the backward can start
    rest = time_f - alone
    took = pair_time(rest, comm_f * rest / time_f, time_b, comm_b) if rest > 0 else rest + time_b
    if took >= rest + time_b:  # nothing hidden: back to back, exactly
        start_b = max(ready_b, ready_f + time_f)
        return (ready_f, ready_f + time_f), (start_b, start_b + time_b)
    mid = ready_f + alone + took * rest / (rest + time_b)
    return (ready_f, mid), (mid, ready_f + alone + took)
