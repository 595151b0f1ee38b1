"""The ops a run dispatches, per microbatch and per step: on a GPU each is a kernel launch the host pays for.

A GPU runs its kernels asynchronously: the host dispatches op after op (Python, the module calls, autograd's
bookkeeping, the launch itself) while the device works through its queue, so an action takes
max(host time, kernel time); on a CPU host and device are the same threads and the two add
(``local_compute.paced``). The host time is these counts × the host's seconds per dispatched op
(``HardwareProfile.launch``). ``modelpar.training.dispatch.count_dispatch`` counts them from the model itself
(a ``TorchDispatchMode`` over its forward and backward at tiny shapes); pure numbers here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DispatchCounts"]


@dataclass(frozen=True)
class DispatchCounts:
    """ATen ops one rank dispatches: per layer, the embedding and the head (final norm, head, loss with one chunk,
    ``chunk_*`` more per further chunk of the chunked loss) per microbatch, forward and backward (no
    recomputation: the cost model adds the forward again), and per optimizer step (gradient norm, AdamW,
    zeroing) ``step_base + step_per_layer × layers``."""

    layer_forward: int
    layer_backward: int
    embed_forward: int
    embed_backward: int
    head_forward: int
    head_backward: int
    step_base: int = 0
    step_per_layer: int = 0
    chunk_forward: int = 0
    chunk_backward: int = 0

    def step(self, layers: int) -> int:
        """Ops of one optimizer step over ``layers`` layers and the ends."""
        return self.step_base + self.step_per_layer * layers

    def head(self, chunks: int) -> tuple[int, int]:
        """(forward, backward) ops of the final norm, head and loss with the loss in ``chunks`` chunks (1: whole)."""
        more = max(0, chunks - 1)
        return self.head_forward + more * self.chunk_forward, self.head_backward + more * self.chunk_backward
