"""The single-process facts behind Megatron's split choices (§5.1–5.2), computed, not asserted.

``matmul_splits``: both ways of splitting Y = X·A are exact, but GeLU does not distribute over
the row split's partial sums. ``mlp_splits``: the column-then-row MLP on t simulated ranks equals
the unsplit one, while one rank's partial sum alone is far off (the all-reduce is needed).
The default settings are the ones that reproduce the reference text's numbers (3.3 and ≈ 2).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from modelpar._validate import check_divisible, check_int

__all__ = ["matmul_splits", "mlp_splits"]


def matmul_splits(seed: int = 0, rows: int = 2, inner: int = 8, cols: int = 64) -> dict[str, float]:
    """§5.1 with 2 "ranks", float64, X ~ N(0,1)^(rows×inner), A ~ N(0,1)^(inner×cols).

    ``column_error``: max |[X·A₁, X·A₂] − X·A|; ``row_error``: max |X₁·A₁ + X₂·A₂ − X·A|;
    ``gelu_gap``: max |GeLU(X₁A₁ + X₂A₂) − (GeLU(X₁A₁) + GeLU(X₂A₂))| (the reference: 3.3).
    """
    check_divisible("inner", check_int("inner", inner, minimum=2), "2 ranks", 2)
    check_divisible("cols", check_int("cols", cols, minimum=2), "2 ranks", 2)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(check_int("rows", rows, minimum=1), inner, generator=gen, dtype=torch.float64)
    a = torch.randn(inner, cols, generator=gen, dtype=torch.float64)
    y = x @ a
    a_cols, (x1, x2), (a1, a2) = a.chunk(2, dim=1), x.chunk(2, dim=1), a.chunk(2, dim=0)
    p1, p2 = x1 @ a1, x2 @ a2
    return {
        "column_error": (torch.cat([x @ ac for ac in a_cols], dim=1) - y).abs().max().item(),
        "row_error": (p1 + p2 - y).abs().max().item(),
        "gelu_gap": (F.gelu(p1 + p2) - (F.gelu(p1) + F.gelu(p2))).abs().max().item(),
    }


def mlp_splits(t: int, seed: int = 0, rows: int = 2, hidden: int = 64) -> dict[str, float]:
    """§5.2 on t simulated ranks: Z = GeLU(X·A)·B, A [h, 4h] by columns, B [4h, h] by rows.

    Weights are drawn like ``nn.Linear`` (N(0,1)/√fan_in). ``error``: max |Σᵢ GeLU(X·Aᵢ)·Bᵢ − Z|;
    ``partial_gap``: max |GeLU(X·A₀)·B₀ − Z|, what rank 0 holds without the all-reduce;
    ``weight_fraction``: the share of A and B one rank stores (1/t).
    """
    t = check_int("t", t, minimum=1)
    hidden = check_int("hidden", hidden, minimum=1)
    check_divisible("4 * hidden", 4 * hidden, "t", t)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(check_int("rows", rows, minimum=1), hidden, generator=gen, dtype=torch.float64)
    a = torch.randn(hidden, 4 * hidden, generator=gen, dtype=torch.float64) / math.sqrt(hidden)
    b = torch.randn(4 * hidden, hidden, generator=gen, dtype=torch.float64) / math.sqrt(4 * hidden)
    z = F.gelu(x @ a) @ b
    partials = [F.gelu(x @ ai) @ bi for ai, bi in zip(a.chunk(t, dim=1), b.chunk(t, dim=0))]
    return {
        "error": (sum(partials) - z).abs().max().item(),
        "partial_gap": (partials[0] - z).abs().max().item(),
        "weight_fraction": (a.chunk(t, dim=1)[0].numel() + b.chunk(t, dim=0)[0].numel()) / (a.numel() + b.numel()),
    }
