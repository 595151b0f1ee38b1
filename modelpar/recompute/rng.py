"""Replay a forward exactly: the RNG and autocast state a segment started with.

Dropout draws from the global generator. If backward re-ran a segment with the generator where
it happens to be then, the masks would differ from the forward's and so would the gradients.
So each checkpoint records the CPU generator (and the CUDA generator of the input's device) and
the autocast mode, and the re-run restores them inside ``torch.random.fork_rng``, which puts the
caller's generators back afterwards: recomputation leaves the random stream untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["ForwardState", "capture_state", "replay"]


@dataclass(frozen=True)
class ForwardState:
    """What a segment's forward depended on besides its input and parameters."""

    cpu_rng: torch.Tensor
    cuda_device: int | None  # the input's CUDA device, whose generator was recorded
    cuda_rng: torch.Tensor | None
    autocast_device: str | None  # "cpu" or "cuda" when autocast can apply, else None
    autocast_enabled: bool
    autocast_dtype: torch.dtype | None


def capture_state(x: torch.Tensor) -> ForwardState:
    """Record the generators and autocast mode a forward on ``x``'s device is about to use."""
    cuda_device = x.device.index if x.is_cuda else None
    if cuda_device is None and x.is_cuda:
        cuda_device = torch.cuda.current_device()
    cuda_rng = torch.cuda.get_rng_state(cuda_device) if cuda_device is not None else None
    device_type = x.device.type if x.device.type in ("cpu", "cuda") else None
    enabled = bool(device_type and torch.is_autocast_enabled(device_type))
    dtype = torch.get_autocast_dtype(device_type) if device_type else None
    return ForwardState(torch.get_rng_state(), cuda_device, cuda_rng, device_type, enabled, dtype)


@contextlib.contextmanager
def replay(state: ForwardState) -> Iterator[None]:
    """Run the body with the recorded generators and autocast mode; restore the caller's after."""
    devices = [state.cuda_device] if state.cuda_device is not None else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.set_rng_state(state.cpu_rng)
        if state.cuda_rng is not None and state.cuda_device is not None:
            torch.cuda.set_rng_state(state.cuda_rng, state.cuda_device)
        if state.autocast_device is None:
            autocast: contextlib.AbstractContextManager = contextlib.nullcontext()
        else:
            autocast = torch.autocast(state.autocast_device, dtype=state.autocast_dtype, enabled=state.autocast_enabled)
        with autocast:
            yield
