"""The messages a schedule sends between devices, in the order they are sent and consumed.

Gloo matches point-to-point messages by tag; NCCL ignores tags and matches each pair's sends
and receives in the order they are posted. A schedule runs on NCCL only if, for every ordered
pair of devices, the sender's order equals the receiver's — ``check_fifo_order`` checks that.
"""

from __future__ import annotations

from modelpar.schedules.action import Kind
from modelpar.schedules.schedule import Schedule

__all__ = ["Message", "pair_messages", "check_fifo_order"]

Message = tuple[str, int, int]  # ("act" | "grad", stage the tensor enters or leaves, microbatch)


def pair_messages(schedule: Schedule) -> tuple[dict[tuple[int, int], list[Message]],
                                               dict[tuple[int, int], list[Message]]]:
    """Per (src, dst) device pair: messages in send order, and in the receiver's consumption order."""
    dev, last = schedule.stage_to_device, schedule.num_stages - 1
    grad_kind = Kind.I if schedule.split_backward else Kind.B
    sent: dict[tuple[int, int], list[Message]] = {}
    recv: dict[tuple[int, int], list[Message]] = {}
    for d, actions in enumerate(schedule.actions):
        for a in actions:
            s, m = a.stage, a.microbatch
            if a.kind is Kind.F:
                if s < last and dev[s + 1] != d:
                    sent.setdefault((d, dev[s + 1]), []).append(("act", s + 1, m))
                if s > 0 and dev[s - 1] != d:
                    recv.setdefault((dev[s - 1], d), []).append(("act", s, m))
            elif a.kind is grad_kind:
                if s > 0 and dev[s - 1] != d:
                    sent.setdefault((d, dev[s - 1]), []).append(("grad", s, m))
                if s < last and dev[s + 1] != d:
                    recv.setdefault((dev[s + 1], d), []).append(("grad", s + 1, m))
    return sent, recv


def check_fifo_order(schedule: Schedule) -> None:
    """Raise ValueError unless every device pair consumes messages in the order they are sent."""
    sent, recv = pair_messages(schedule)
    for pair in sorted(set(sent) | set(recv)):
        out, into = sent.get(pair, []), recv.get(pair, [])
        for i, (a, b) in enumerate(zip(out, into)):
            if a != b:
                raise ValueError(
                    f"schedule {schedule.name or '(hand-written)'} cannot run on a backend that matches "
                    f"messages in order (NCCL): device {pair[0]} sends {_name(a)} as its message #{i} to "
                    f"device {pair[1]}, which expects {_name(b)} there; reorder the actions or use gloo"
                )


def _name(msg: Message) -> str:
    kind, stage, m = msg
    what = "activation entering" if kind == "act" else "gradient leaving"
    return f"the {what} stage {stage} for microbatch {m}"
