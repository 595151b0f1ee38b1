"""Split an ``nn.Sequential`` into K contiguous pipeline stages, balanced by size or by measured time.

Like torchgpipe's ``balance_by_size`` / ``balance_by_time`` (Kim et al. 2020, ``torchgpipe.balance``): give every
layer a cost, then cut the layer list into K runs so that the costliest stage — which sets the
pipeline's clock (reference text §2.2) — is as cheap as possible. The cut is exact (dynamic
programming), not a heuristic; among equally good cuts it keeps the stages' layer counts even.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence

import torch
from torch import nn

from modelpar._validate import check_int

__all__ = ["balance_by_cost", "balance_by_size", "balance_by_time", "layer_times", "split_sequential"]


def _check_sequential(module: nn.Module) -> nn.Sequential:
    if not isinstance(module, nn.Sequential):
        raise ValueError(f"module must be an nn.Sequential, got {type(module).__name__}")
    return module


def balance_by_cost(costs: Sequence[float], partitions: int) -> list[int]:
    """Layers per stage for ``partitions`` contiguous stages minimising the largest stage cost.

    ``costs[i]`` is layer i's cost (>= 0). Ties go to the cut whose largest stage has the fewest
    layers. Runs in O(K·n²), fine for the hundreds of layers a model has.
    """
    n = len(costs)
    k = check_int("partitions", partitions, minimum=1)
    if n == 0:
        raise ValueError("costs must hold at least one layer, got an empty list")
    if k > n:
        raise ValueError(f"partitions ({k}) must be <= the number of layers ({n})")
    if any(not c >= 0 for c in costs):  # also catches NaN
        raise ValueError(f"costs must be >= 0, got {list(costs)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    # best[p][i]: lexicographically smallest max (cost, layers) over cuts of the first i layers
    # into p stages; a total order, so the usual min-max recurrence is exact.
    inf = (float("inf"), n + 1)
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = (0.0, 0)
    for p in range(1, k + 1):
        for i in range(p, n - (k - p) + 1):
            for j in range(p - 1, i):
                score = max(best[p - 1][j], (prefix[i] - prefix[j], i - j))
                if score < best[p][i]:
                    best[p][i], cut[p][i] = score, j
    balance, i = [], n
    for p in range(k, 0, -1):
        j = cut[p][i]
        balance.append(i - j)
        i = j
    return balance[::-1]


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
