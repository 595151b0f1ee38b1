"""Where the two halves of an overlapped F&B pair run: two CUDA streams on a GPU, one after the other on a CPU.

DualPipe (DeepSeek-V3 report §3.2.1) runs a forward and another microbatch's backward together so
that one's communication hides behind the other's compute. Autograd runs a backward on the stream
its forward ran on, so the pair's forward goes to the stream its partner's graph is NOT on: the
backward's kernels (and its MoE all-to-alls, which wait only on their own stream) proceed on one
stream while the forward's are issued on the other. Outside pairs everything runs on the current
stream; a pair starts with the side stream waiting for it and ends with it waiting for the side
stream, and tensors that cross streams are recorded on the stream that uses them last, so the
caching allocator never hands their memory out early. On a CPU (or without CUDA) the same calls
are no-ops: the halves run one after the other, in the schedule's order — same numerics.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["PairStreams"]


class PairStreams:
    """The streams of one rank's overlapped pairs; ``half`` wraps each action (paired or not)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.device = device
        self._side: Any = None  # created on first use
        self._graph: dict[tuple[int, int], Any] = {}  # (stage, microbatch) -> stream its forward ran on

    def _streams(self) -> tuple[Any, Any]:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return torch.cuda.current_stream(self.device), self._side

    @contextmanager
    def half(self, action: Any, pair: int, partner: tuple[int, int] | None) -> Iterator[None]:
        """Run ``action`` (pair 0: alone, 1: a pair's forward, 2: its backward) on its stream; what the
        body waits for (its receive) orders that stream.

        ``partner``: for a forward, the (stage, microbatch) of the backward it is paired with.
        """
        if not self.cuda:
            yield
            return
        key = (action.stage, action.microbatch)
        main, side = self._streams()
        if pair == 0:
            yield
            if action.kind.value == "F":
                self._graph[key] = main
            return
        if pair == 1:
            partner_stream = self._graph.get(partner, main) if partner is not None else main
            stream = side if partner_stream is main else main
            side.wait_stream(main)
        else:
            stream = self._graph.get(key, main)
        with torch.cuda.stream(stream):
            yield
        if pair == 1:
            self._graph[key] = stream
        else:
            main.wait_stream(side)  # the pair is done: what follows on the current stream sees both halves

    def used(self, x: Any) -> None:
        """A pair half's input: recorded on the half's stream (the current one), which reads it."""
        if self.cuda and isinstance(x, torch.Tensor) and x.is_cuda:
            x.record_stream(torch.cuda.current_stream(self.device))

    def produced(self, y: Any) -> None:
        """A pair half's output: recorded on the current stream, where it is sent or handed over."""
        if self.cuda and isinstance(y, torch.Tensor) and y.is_cuda:
            y.record_stream(torch.cuda.current_stream(self.device))

    def forget(self, stage: int, microbatch: int) -> None:
        """The backward of (stage, microbatch) has run: its graph is gone."""
        self._graph.pop((stage, microbatch), None)
