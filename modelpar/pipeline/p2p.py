"""Point-to-point transfers between pipeline devices: async sends, early receives, tagged.

A device is a rank of the pipeline process GROUP (group rank d runs the schedule's device d);
torch.distributed addresses peers by GLOBAL rank, so every peer is translated once. In a
(pp, dp, tp) mesh the pp group holds ranks with equal dp and tp indices, so each tensor-parallel
rank of a stage talks to the same tensor-parallel rank of its neighbours.

Each message carries a tag naming what it is, so receives can be posted in any order and
matched by (source, tag), never by arrival order::

    tag = 2 · (stage · M + microbatch) + 0    activation entering ``stage``
    tag = 2 · (stage · M + microbatch) + 1    gradient leaving ``stage`` (to stage - 1)

Sends never block (``isend``); a receive blocks only when the action that needs it starts, so a
schedule that passes ``Schedule.validate`` cannot deadlock. Waits have a timeout that turns a
hang into a ``TimeoutError`` naming this rank, the peer and the action that waited.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["P2P", "act_tag", "comm_device", "grad_tag", "matches_by_tag"]


def comm_device(group: Any) -> torch.device:
    """Where this rank's communication buffers live: its current GPU under NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend(group)):  # "nccl", or a mixed "cpu:gloo,cuda:nccl"
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def matches_by_tag(group: Any) -> bool:
    """Gloo matches point-to-point messages by tag; NCCL ignores tags and pairs them by order."""
    return "nccl" not in str(dist.get_backend(group))


def act_tag(stage: int, microbatch: int, num_microbatches: int) -> int:
    """Tag of the activation that enters ``stage`` for ``microbatch``."""
    return 2 * (stage * num_microbatches + microbatch)


def grad_tag(stage: int, microbatch: int, num_microbatches: int) -> int:
    """Tag of the gradient that ``stage`` sends back to ``stage - 1`` for ``microbatch``."""
    return 2 * (stage * num_microbatches + microbatch) + 1


class P2P:
    """Sends and receives between the devices (group ranks) of one pipeline group."""

    def __init__(self, group: Any, timeout: float, compute_device: torch.device | None = None) -> None:
        self.group = group
        self.ranks: list[int] = dist.get_process_group_ranks(group)  # device -> global rank
        self.device = dist.get_rank(group)
        self.rank = dist.get_rank()
        self.buffer_device = comm_device(group)  # the CPU for gloo: GPU tensors are staged through it
        self.compute_device = compute_device or self.buffer_device  # where received tensors are used
        self.timeout = datetime.timedelta(seconds=timeout)
        self._sends: list[tuple[Any, torch.Tensor, str]] = []

    def send(self, tensor: torch.Tensor, device: int, tag: int, what: str) -> None:
        """Start sending ``tensor`` to ``device``; it is kept alive until the send completes."""
        tensor = tensor.to(self.buffer_device).contiguous()
        work = dist.isend(tensor, dst=self.ranks[device], group=self.group, tag=tag)
        self._sends.append((work, tensor, what))
        if len(self._sends) > 8:  # drop finished sends so their tensors can be freed
            self._sends = [s for s in self._sends if not s[0].is_completed()]

    def post_recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: int, tag: int) -> tuple[Any, torch.Tensor]:
        """Post a receive into a fresh buffer; ``wait`` it when the data is needed."""
        buf = torch.empty(shape, dtype=dtype, device=self.buffer_device)
        return dist.irecv(buf, src=self.ranks[device], group=self.group, tag=tag), buf

    def wait(self, posted: tuple[Any, torch.Tensor], device: int, what: str) -> torch.Tensor:
        """Block until a posted receive completes, or raise TimeoutError naming ``what``."""
        work, buf = posted
        self._wait(work, f"{what} from rank {self.ranks[device]}")
        return buf.to(self.compute_device)

    def finish(self) -> None:
        """Wait for every send still in flight (end of a step)."""
        sends, self._sends = self._sends, []
        for work, _, what in sends:
            self._wait(work, what)

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as err:  # gloo: "Timed out waiting ... for recv operation"
            if "imed out" not in str(err) and "imeout" not in str(err):
                raise
            seconds = self.timeout.total_seconds()
            raise TimeoutError(
                f"rank {self.rank} (pipeline device {self.device}) waited {seconds:g} s for {what}; "
                "the peer failed or hung (its error names the cause)"
            ) from None
