"""The built-in MLP the benchmarks time: blocks h → 4h → GELU → h, seeded alike on every rank."""

from __future__ import annotations

import torch
from torch import nn

from modelpar._validate import check_int

__all__ = ["mlp_model", "mlp_stage"]


def mlp_stage(hidden: int, blocks: int = 1) -> nn.Sequential:
    """``blocks`` MLP blocks h → 4h → GELU → h (3 layers each)."""
    h = check_int("hidden", hidden, minimum=1)
    layers: list[nn.Module] = []
    for _ in range(check_int("blocks", blocks, minimum=1)):
        layers += [nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)]
    return nn.Sequential(*layers)


def mlp_model(width: int, blocks: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Sequential:
    """``mlp_stage(width, blocks)`` built under ``seed`` (the global random state is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(check_int("seed", seed))
        return mlp_stage(width, blocks).to(dtype)
