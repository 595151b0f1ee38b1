"""One virtual pipeline stage held by this rank: its module and the microbatches it keeps for backward.

An interleaved schedule gives a rank several of these (one per model chunk). Each forward
detaches its input from the previous stage's graph, so a stage's backward ends at its own
input and the input gradient can be sent back by hand (§3.4: we schedule each microbatch's
backward ourselves instead of letting autograd run the whole model).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from modelpar.pipeline.split_backward import backward_input

__all__ = ["LocalStage", "LossFn"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class LocalStage:
    """Virtual stage ``index`` of ``num_stages`` on this rank: forward, backward, and the split I / W.

    (torch.distributed.pipelining's ``PipelineStage`` also owns communication; this one only
    computes: the executor moves the tensors.)
    """

    def __init__(self, index: int, module: nn.Module, num_stages: int, loss_fn: LossFn | None = None) -> None:
        self.index = index
        self.module = module
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        self.loss_fn = loss_fn
        self._saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}  # mb -> (input, output)
        self._weight: dict[int, Callable[[], None]] = {}  # mb -> deferred W (zero bubble)

    @property
    def held(self) -> int:
        """Microbatches whose activations this stage keeps: F done, B or W not yet (a pending W restarts
        from the retained graph: ``schedules.memory``'s count)."""
        return len(self._saved) + len(self._weight)

    def forward(self, microbatch: int, x: torch.Tensor, target: torch.Tensor | None = None,
                scale: float = 1.0, for_backward: bool = True) -> torch.Tensor:
        """Run the module; return the detached output, or on the last stage the unscaled loss.

        The last stage keeps ``loss · scale`` for backward: with ``scale`` = rows / batch rows
        the microbatch gradients add up to the gradient of the whole batch's mean loss.
        ``for_backward=False`` (evaluation, under no_grad) keeps nothing.
        """
        needs_grad = for_backward and not self.is_first and x.is_floating_point()
        x_in = x.detach().requires_grad_(needs_grad)
        out = self.module(x_in)
        if not self.is_last:
            if for_backward:
                self._saved[microbatch] = (x_in if needs_grad else None, out)
            return out.detach()
        if self.loss_fn is None or target is None:
            raise ValueError(f"the last stage ({self.index}) needs a loss_fn and targets")
        loss = self.loss_fn(out, target)
        if for_backward:
            self._saved[microbatch] = (x_in if needs_grad else None, loss * scale)
        return loss.detach()

    def backward(self, microbatch: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Full backward (B): accumulate weight grads, return the input grad (None on stage 0)."""
        x_in, out = self._saved.pop(microbatch)
        if out.requires_grad:
            torch.autograd.backward([out], [grad] if grad is not None else None)
        if x_in is None:
            return None
        return x_in.grad if x_in.grad is not None else torch.zeros_like(x_in)

    def backward_input(self, microbatch: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """I of a split backward: the input grad now, the weight grads kept for ``backward_weight``."""
        x_in, out = self._saved.pop(microbatch)
        gx, self._weight[microbatch] = backward_input(out, grad, x_in)
        return gx

    def backward_weight(self, microbatch: int) -> None:
        """W of a split backward: accumulate the weight grads deferred by ``backward_input``."""
        self._weight.pop(microbatch)()

    def clear(self) -> None:
        """Drop everything held (after a failed step)."""
        self._saved.clear()
        self._weight.clear()
