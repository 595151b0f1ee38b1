"""Dropout on a shard that reproduces the single-process mask.

Every rank draws the mask of the *full* tensor from the shared seed and keeps its own slice,
so a t-rank run drops exactly the elements a one-process run drops (and ranks never share a
pattern across heads or sequence shards). The price is t× the random numbers; Megatron
instead forks a per-rank RNG state, which is cheaper but not reproducible across t.
"""

from __future__ import annotations

import torch

__all__ = ["sliced_dropout"]


def sliced_dropout(x: torch.Tensor, p: float, training: bool, dim: int = 0, rank: int = 0,
                   world: int = 1) -> torch.Tensor:
    """Dropout of ``x``, rank ``rank``'s slice along ``dim`` of a full tensor ``world`` times larger.

    With world = 1 this is ``F.dropout`` (same random draws: bernoulli over the whole tensor).
    """
    if not training or p == 0.0:
        return x
    full = list(x.shape)
    full[dim] *= world
    keep = torch.empty(full, dtype=x.dtype, device=x.device).bernoulli_(1.0 - p)
    if world > 1:
        keep = keep.narrow(dim, rank * x.shape[dim], x.shape[dim])
    return x * keep.div_(1.0 - p)
