"""Split an ``nn.Sequential`` into K contiguous pipeline stages, balanced by size or by measured time.

Like torchgpipe's ``balance_by_size`` / ``balance_by_time`` (Kim et al. 2020, ``torchgpipe.balance``): give every
layer a cost, then cut the layer list into K runs so that the costliest stage — which sets the
pipeline's clock (reference text §2.2) — is as cheap as possible. The cut is exact (dynamic
programming, ``modelpar.layer_split.balance_by_cost``), not a heuristic; among equally good cuts it
keeps the one nearest the default split, the one the planner and the trainer use.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence

import torch
from torch import nn

from modelpar._validate import check_int
from modelpar.layer_split import balance_by_cost

__all__ = ["balance_by_cost", "balance_by_size", "balance_by_time", "layer_times", "split_sequential"]


def _check_sequential(module: nn.Module) -> nn.Sequential:
    if not isinstance(module, nn.Sequential):
        raise ValueError(f"module must be an nn.Sequential, got {type(module).__name__}")
    return module


def balance_by_size(module: nn.Sequential, partitions: int) -> list[int]:
    """Balance by parameter count (a proxy for both memory and compute per layer)."""
    layers = list(_check_sequential(module))
    return balance_by_cost([sum(p.numel() for p in layer.parameters()) for layer in layers], partitions)


def layer_times(module: nn.Sequential, sample: torch.Tensor, repeats: int = 3) -> list[float]:
    """Each layer's forward + backward time in seconds on ``sample`` (the fastest of ``repeats``).

    Measured on a copy, so the model's gradients and running statistics (BatchNorm) are untouched.
    """
    layers = list(copy.deepcopy(_check_sequential(module)))
    repeats = check_int("repeats", repeats, minimum=1)
    if not isinstance(sample, torch.Tensor):
        raise ValueError(f"sample must be a tensor, got {type(sample).__name__}")
    times, x = [], sample.detach()
    for layer in layers:
        best = float("inf")
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            best = min(best, time.perf_counter() - start)
        times.append(best)
        x = out.detach()
    return times


def balance_by_time(module: nn.Sequential, sample: torch.Tensor, partitions: int, repeats: int = 3) -> list[int]:
    """Balance by each layer's measured forward + backward time on ``sample``."""
    check_int("partitions", partitions, minimum=1)
    return balance_by_cost(layer_times(module, sample, repeats), partitions)


def split_sequential(module: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """Cut ``module`` into consecutive ``nn.Sequential`` stages of ``balance[j]`` layers each."""
    layers = list(_check_sequential(module))
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence) or len(balance) == 0:
        raise ValueError(f"balance must be a non-empty list of layer counts, got {balance!r}")
    counts = [check_int(f"balance[{j}]", b, minimum=1) for j, b in enumerate(balance)]
    if sum(counts) != len(layers):
        raise ValueError(f"balance must add up to the number of layers ({len(layers)}), got {list(balance)}")
    stages, start = [], 0
    for count in counts:
        stages.append(nn.Sequential(*layers[start : start + count]))
        start += count
    return stages
