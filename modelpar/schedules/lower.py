"""Lowering: a schedule's communication made explicit, one program per rank, matched by order.

A rank's program is its compute actions plus the sends and receives they imply, written in
torch.distributed.pipelining's ``_Action`` text form::

    0F3       stage 0: forward of microbatch 3        1B3       stage 1: backward of microbatch 3
    0SEND_F3  stage 0 sends that forward's output     1SEND_B3  stage 1 sends its input gradient back
    1RECV_F3  stage 1 receives it                     0RECV_B3  stage 0 receives it

The stage of a send or receive is the one on this rank (the sender's for SEND, the receiver's
for RECV); I sends and receives like B. Stages on the same rank hand tensors over in memory:
no message. The invariant that makes tags unnecessary: between any two ranks, the messages
appear in the same order at both ends (a send at one end where the other has its receive), in
both directions taken together. NCCL pairs a pair's operations by order, and so does gloo with
one tag, so every message meets its own receive.

``lower`` runs the schedule as blocking processes (the simulator's execution). Each time an
action runs it is appended to its rank's program, followed by a SEND per rank that needs
its output, and that rank gets the RECV at the same moment: both ends see each pair's messages
in one global order. Each RECV then moves up past compute actions to just after the previous
send: receives are posted as early as the order of the messages allows, so transfers overlap
compute, and that order — per pair and per rank — is left as it was. An overlapped F&B pair
(``Schedule.overlapped``) is lowered as a unit: its two actions, then the forward's sends, then
the backward's (both halves compute before either output leaves, as they run together).

``rendezvous`` is the check that the result cannot hang on NCCL: zero buffering (a send
completes only when its receive is reached and vice versa), posted operations progressing in
program order on one channel per pair (or, stricter, one per rank), compute waiting for its
received inputs. Lowered programs pass both.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence
from enum import Enum
from typing import NamedTuple

from modelpar.schedules.action import Action, Kind
from modelpar.schedules.diagnosis import DeadlockError, deadlock_chain
from modelpar.schedules.kinds import KINDS, SPECS, STYLES, VALUES, describe_message, inputs_of, producers, style_of
from modelpar.schedules.replay import replay_traced
from modelpar.schedules.schedule import Schedule

__all__ = ["Comm", "Op", "Transfer", "lower", "parse_op", "rendezvous"]


class Comm(str, Enum):
    """What a communication operation does."""

    SEND_F = "SEND_F"  # send a forward's output to the next stage's rank
    RECV_F = "RECV_F"  # receive the previous stage's output
    SEND_B = "SEND_B"  # send a backward's input gradient to the previous stage's rank
    RECV_B = "RECV_B"  # receive the next stage's input gradient

    def __str__(self) -> str:
        return self.value


_SENDS = (Comm.SEND_F, Comm.SEND_B)
_VALUE = {v.message: v for v in VALUES if v.message}  # "F" -> the activation, "B" -> the input gradient


class Transfer(NamedTuple):
    """A send or receive of ``stage`` (the stage on this rank) for ``microbatch``: ``1RECV_F3``."""

    stage: int
    kind: Comm
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @property
    def is_send(self) -> bool:
        return self.kind in _SENDS

    @property
    def peer_stage(self) -> int:
        """The stage at the other end: s + 1 for SEND_F and RECV_B, s - 1 for RECV_F and SEND_B."""
        step = _VALUE[self.kind.value[-1]].consumer
        return self.stage + (step if self.is_send else -step)

    @property
    def message(self) -> tuple[str, int, int]:
        """What travels, the same at both ends: (F or B, the producing stage, microbatch)."""
        producer = self.stage if self.is_send else self.peer_stage
        return (self.kind.value[-1], producer, self.microbatch)


Op = Action | Transfer
_OP_NAMES = "|".join([c.value for c in Comm] + [k.value for k in KINDS])
_OP_RE = re.compile(rf"^(\d+)({_OP_NAMES})(\d+)$")


def parse_op(text: str) -> Op:
    """Parse ``0F3``, ``0SEND_F3``, ``1RECV_B2`` ... into an Action or a Transfer."""
    match = _OP_RE.match(text.strip())
    if match is None:
        raise ValueError(f"operation must look like <stage><{_OP_NAMES}><microbatch>, got {text!r}")
    stage, kind, mb = int(match[1]), match[2], int(match[3])
    return Action(stage, Kind(kind), mb) if len(kind) == 1 else Transfer(stage, Comm(kind), mb)


def lower(schedule: Schedule) -> tuple[tuple[Op, ...], ...]:
    """One program per rank: ``schedule``'s actions with their sends and receives, matched by order.

    Raises ValueError naming the first offending action for an incomplete or misordered schedule,
    and DeadlockError naming the first operation that can never complete for one that would hang
    — the same on every rank, before anything is sent.
    """
    try:
        schedule.validate()
    except DeadlockError:
        raise DeadlockError(_hang_message(schedule)) from None
    return tuple(_hoist_receives(p) for p in _programs(schedule))


def _consumers(schedule: Schedule, a: Action) -> list[tuple[int, Transfer, Transfer]]:
    """For each other rank that needs ``a``'s output: (that rank, our SEND, its RECV)."""
    dev, s, m = schedule.stage_to_rank, a.stage, a.microbatch
    out = []
    for v in SPECS[a.kind].produces:
        t = s + v.consumer
        if v.message and 0 <= t < len(dev) and dev[t] != dev[s]:
            out.append((dev[t], Transfer(s, Comm("SEND_" + v.message), m), Transfer(t, Comm("RECV_" + v.message), m)))
    return out


def _programs(schedule: Schedule) -> list[list[Op]]:
    """Each action appended when it runs (blocking execution), its SENDs after it, their RECVs at
    the receivers at the same moment."""
    programs: list[list[Op]] = [[] for _ in range(schedule.num_ranks)]
    dev = schedule.stage_to_rank
    firsts = {acts[i] for acts, pairs in zip(schedule.actions, schedule.overlapped) for i in pairs}
    held: list[tuple[int, Transfer, Transfer]] = []  # a pair's forward's messages, sent after its backward
    for a in replay_traced(schedule).order:  # a pair's two actions come one right after the other
        d = dev[a.stage]
        programs[d].append(a)
        if a in firsts:
            held = _consumers(schedule, a)
            continue
        for peer, send, recv in held + _consumers(schedule, a):
            programs[d].append(send)
            programs[peer].append(recv)
        held = []
    return programs


def _hoist_receives(program: list[Op]) -> tuple[Op, ...]:
    """Move each RECV up past compute actions, to just after the previous send (or to the start).

    The order of the sends and receives among themselves is kept — per pair and per rank — so
    the matching is unchanged and neither kind of NCCL channel can hang; only posting gets earlier.
    """
    anchor = -1  # the latest SEND: receives after it float up to it
    keys = []
    for i, op in enumerate(program):
        if isinstance(op, Transfer) and not op.is_send:
            keys.append((anchor, 1, i))
        else:
            if isinstance(op, Transfer):
                anchor = i
            keys.append((i, 0, i))
    return tuple(program[i] for _, _, i in sorted(keys))


def _remote_input(action: Action, dep: Action) -> str:
    """The letter of the message through which ``action`` gets ``dep``'s output from another stage."""
    return next(v.message for v, p in inputs_of(action.kind, action.stage) if p == dep.stage and v.message)


def _hang_message(schedule: Schedule) -> str:
    """Name the operations a deadlocking schedule would wait on forever, as a chain of ranks."""
    chain = []
    for d, _, a, dep, owner in deadlock_chain(schedule, replay_traced(schedule).stuck):
        x = _remote_input(a, dep)
        chain.append(f"rank {d} waits at {Transfer(a.stage, Comm('RECV_' + x), a.microbatch)} (the input of {a}), "
                     f"but rank {owner} never reaches {Transfer(dep.stage, Comm('SEND_' + x), dep.microbatch)}")
    label = f" {schedule.name!r}" if schedule.name else ""
    return (f"cannot lower schedule{label}: it would hang: " + "; ".join(chain)
            + " (a cycle: none of these operations can ever complete)")


# --- the rendezvous model ---------------------------------------------------------------------
def rendezvous(programs: Sequence[Sequence[Op]], stage_to_rank: Sequence[int], channel: str = "pair") -> str | None:
    """None if ``programs`` run to the end with zero buffering; else the first operation that cannot.

    Each rank walks its program: a SEND or RECV is posted (it does not block the rank; a
    SEND waits for its producer), a compute action waits for its inputs — local ones computed
    before it, remote ones received. Posted operations complete in order on a channel: with
    ``channel="pair"`` each pair of ranks has one (NCCL's single ``isend``/``irecv``, a
    communicator per pair), with ``channel="rank"`` each rank has one for all its peers (a
    single NCCL stream, as batched P2P uses): the head operation of a channel meets the head of
    the peer's, and both complete together only if one is the send and the other the receive of
    the same message — no buffering. What a program must satisfy not to hang on NCCL.
    """
    if channel not in ("pair", "rank"):
        raise ValueError(f"channel must be one of {{pair, rank}}, got {channel!r}")
    per_pair = channel == "pair"
    dev = tuple(stage_to_rank)
    last = len(dev) - 1
    made = producers(style_of({op.kind for p in programs for op in p if isinstance(op, Action)}) or STYLES[-1])
    n = len(programs)
    ptr = [0] * n
    done: set[object] = set()  # computed actions, and messages received (by their ``message``)
    parked: dict[object, list[int]] = {}
    queues: dict[tuple[int, int], deque[tuple[Transfer, int]]] = {}  # channel -> posted, unmatched ops
    ready = list(range(n - 1, -1, -1))

    def needs(op: Op, d: int) -> list[Action | tuple[str, int, int]]:
        """A send needs its producer; a compute action its inputs: local actions, or messages received."""
        s, m = op.stage, op.microbatch
        if isinstance(op, Transfer):
            return [Action(s, made[_VALUE[op.message[0]]], m)] if op.is_send else []
        return [Action(p, made[v], m) if dev[p] == d else (v.message, p, m)
                for v, p in inputs_of(op.kind, s) if 0 <= p <= last]

    def queue(d: int, peer: int) -> deque[tuple[Transfer, int]]:
        return queues.setdefault((d, peer) if per_pair else (d, -1), deque())

    def match(d: int, peer: int) -> str | None:
        """Complete the operations that meet at the heads of d's and peer's channels, as far as they go."""
        pending = [(d, peer)]
        while pending:
            x, y = pending.pop()
            mine, theirs = queue(x, y), queue(y, x)
            while mine and theirs:
                (a, i), (b, j) = mine[0], theirs[0]
                if dev[a.peer_stage] != y or dev[b.peer_stage] != x:
                    break  # one channel per rank: a head waits for another peer
                if a.message != b.message or a.is_send == b.is_send:
                    return (f"rank {x}'s {a} (position {i}) would be paired with rank {y}'s {b} "
                            f"(position {j}): the next operation between them is not one message's "
                            f"send and receive")
                mine.popleft(), theirs.popleft()
                done.add(a.message)
                ready.extend(parked.pop(a.message, ()))
                if not per_pair:  # new heads may meet other peers
                    pending += [(z, dev[q[0][0].peer_stage]) for z, q in ((x, mine), (y, theirs)) if q]
        return None

    while ready:
        d = ready.pop()
        program = programs[d]
        while ptr[d] < len(program):
            op = program[ptr[d]]
            missing = next((x for x in needs(op, d) if x not in done), None)
            if missing is not None:
                parked.setdefault(missing, []).append(d)
                break
            ptr[d] += 1
            if isinstance(op, Action):
                done.add(op)
                ready.extend(parked.pop(op, ()))
                continue
            peer = dev[op.peer_stage]
            q = queue(d, peer)
            q.append((op, ptr[d] - 1))
            if len(q) == 1 or per_pair:
                error = match(d, peer)
                if error:
                    return error
    for d in range(n):
        if ptr[d] < len(programs[d]):
            op = programs[d][ptr[d]]
            missing = next(x for x in needs(op, d) if x not in done)
            what = str(missing) if isinstance(missing, Action) else describe_message(missing)
            return f"rank {d} never gets past {op} (position {ptr[d]}): it waits for {what}, which never comes"
    for (d, _), q in sorted(queues.items()):
        if q:
            op, i = q[0]
            return (f"rank {d}'s {op} (position {i}) is never matched: rank {dev[op.peer_stage]} posts "
                    f"nothing more to it")
    return None
