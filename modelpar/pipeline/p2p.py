"""Point-to-point messages between pipeline devices: tag-free, matched by the order of the program.

A device is a rank of the pipeline process GROUP (group rank d runs the schedule's device d);
torch.distributed addresses peers by GLOBAL rank, so every peer is translated once. In a
(pp, dp, tp) mesh each tensor-parallel rank of a stage talks to the same tensor-parallel rank of
its neighbours through its own pp group.

Every message of a pair of devices is posted in the order of the lowered programs
(``modelpar.schedules.lower``), which is the same at both ends, so one tag serves them all: NCCL
pairs them by order (it ignores tags) and gloo does too with a single tag. The same code runs on
both backends. Under NCCL tensors stay on the GPU and waits only order the streams; a gloo group
for GPU tensors stages them through host memory.

``check_messages`` sends a small header before each tensor — its sequence number on the pair,
what it is, its stage and microbatch — and the receiver asserts it, so a message that meets the
wrong receive is named at once (rank, peer, operation) instead of corrupting a gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from modelpar.pipeline.bounded_comm import FlightRecorder, comm_device, is_nccl, wait

__all__ = ["P2P", "Posted"]

_KIND = {"F": 0, "B": 1}


@dataclass
class Posted:
    """A receive in flight: its work, the buffer it fills, and its header when messages are checked."""

    work: Any
    buffer: torch.Tensor
    peer: int
    seq: int
    message: tuple[str, int, int]
    what: str
    header: tuple[Any, torch.Tensor] | None = None


class P2P:
    """Sends and receives between the devices (group ranks) of one pipeline group."""

    def __init__(self, group: Any, timeout: float, compute_device: torch.device, recorder: FlightRecorder,
                 check_messages: bool = False) -> None:
        self.group = group
        self.ranks: list[int] = dist.get_process_group_ranks(group)  # group rank -> global rank
        self.group_rank = dist.get_rank(group)
        self.rank = dist.get_rank()
        self.nccl = is_nccl(group)
        self.buffer_device = comm_device(group)  # the CPU under gloo: GPU tensors are staged through it
        self.compute_device = compute_device  # where received tensors are used
        self.timeout = timeout
        self.recorder = recorder
        self.check_messages = check_messages
        self.sends: list[tuple[Any, torch.Tensor, str]] = []  # in flight: kept alive until complete
        self.sent = [0] * len(self.ranks)  # messages sent to / received from each peer, ever
        self.received = [0] * len(self.ranks)

    def connect(self, peers: list[int]) -> None:
        """Exchange one tiny message with each peer, pairs in one global order, before any step.

        NCCL creates a pair's communicator at its first operation and both ends block until the
        other arrives; doing it here, in an order every rank follows, cannot deadlock.
        """
        one = torch.zeros(1, device=self.buffer_device)
        for peer in sorted(peers):
            low = self.group_rank < peer
            op = dist.isend if low else dist.irecv
            work = op(one, self.ranks[peer], group=self.group)
            wait(work, self.timeout, f"the first message with rank {self.ranks[peer]}", self.recorder, self.nccl)

    def send(self, tensor: torch.Tensor, peer: int, message: tuple[str, int, int], what: str) -> None:
        """Start sending ``tensor`` to group rank ``peer``; it is kept alive until the send completes."""
        tensor = tensor.to(self.buffer_device).contiguous()
        seq = self.sent[peer]
        self.sent[peer] += 1
        if self.check_messages:
            header = self._header(seq, message)
            self.sends.append((dist.isend(header, self.ranks[peer], group=self.group), header, what))
        self.sends.append((dist.isend(tensor, self.ranks[peer], group=self.group), tensor, what))

    def post_recv(self, buffer: torch.Tensor, peer: int, message: tuple[str, int, int], what: str) -> Posted:
        """Post a receive into ``buffer`` from group rank ``peer``; ``wait`` for it when the data is needed."""
        seq = self.received[peer]
        self.received[peer] += 1
        header = None
        if self.check_messages:
            buf = torch.empty(4, dtype=torch.int64, device=self.buffer_device)
            header = (dist.irecv(buf, self.ranks[peer], group=self.group), buf)
        work = dist.irecv(buffer, self.ranks[peer], group=self.group)
        return Posted(work, buffer, peer, seq, message, what, header)

    def wait(self, posted: Posted) -> torch.Tensor:
        """The received tensor, on the compute device; a TimeoutError names what never came."""
        where = f"{posted.what} from rank {self.ranks[posted.peer]}"
        if posted.header is not None:
            work, buf = posted.header
            wait(work, self.timeout, where, self.recorder, self.nccl)
            self._check(buf.tolist(), posted)
        if self.nccl:
            posted.work.wait()  # the compute stream waits for the receive; the host goes on
        else:
            wait(posted.work, self.timeout, where, self.recorder)
        return posted.buffer.to(self.compute_device)

    def finish(self) -> None:
        """Wait for every send still in flight (end of a step); under NCCL, order the stream after them."""
        sends, self.sends = self.sends, []
        for work, _, what in sends:
            if self.nccl:
                work.wait()
            else:
                wait(work, self.timeout, what, self.recorder)

    def unfinished(self) -> str | None:
        """The first send still in flight, for the error when a step's end never comes."""
        return next((what for work, _, what in self.sends if not work.is_completed()), None)

    def abandon(self) -> None:
        """Forget every send of a failed step (its peers may never receive them)."""
        self.sends = []

    def _header(self, seq: int, message: tuple[str, int, int]) -> torch.Tensor:
        kind, stage, microbatch = message
        return torch.tensor([seq, _KIND[kind], stage, microbatch], dtype=torch.int64, device=self.buffer_device)

    def _check(self, got: list[int], posted: Posted) -> None:
        kind, stage, microbatch = posted.message
        expected = [posted.seq, _KIND[kind], stage, microbatch]
        if got != expected:
            names = {v: k for k, v in _KIND.items()}

            def describe(h: list[int]) -> str:
                what = "activation" if names.get(h[1]) == "F" else "gradient"
                return f"message #{h[0]}, the {what} of microbatch {h[3]} from stage {h[2]}"

            raise RuntimeError(
                f"{self.recorder.where} received {describe(got)} from rank {self.ranks[posted.peer]} "
                f"(pipeline device {posted.peer}) where it expected {describe(expected)} ({posted.what}): "
                "the two ends' programs post this pair's messages in different orders"
            )
