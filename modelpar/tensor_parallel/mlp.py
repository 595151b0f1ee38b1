"""The Megatron MLP: Z = GeLU(X·A)·B with A split by columns and B by rows (§5.2).

Rank i computes Y_i = GeLU(X·A_i) with no communication (GeLU is element-wise, so it can act on
column blocks), then Z_i = Y_i·B_i, a partial sum; one all-reduce (g) gives Z. Splitting A by
rows instead would need an all-reduce before the GeLU: GeLU(X₁A₁ + X₂A₂) ≠ GeLU(X₁A₁) + GeLU(X₂A₂).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from modelpar._validate import check_divisible, check_int
from modelpar.tensor_parallel._comm import group_size, resolve_group
from modelpar.tensor_parallel.layers import T_NAME, ColumnParallelLinear, RowParallelLinear

__all__ = ["ParallelMLP"]


class ParallelMLP(nn.Module):
    """fc1 (column, h → ffn/t) → GeLU → fc2 (row, ffn/t → h); one all-reduce forward, one backward.

    With ``sequence_parallel`` the input and output are sequence shards [b, s/t, h].
    """

    def __init__(self, hidden: int, ffn_hidden: int | None = None, bias: bool = True, group: Any = None,
                 sequence_parallel: bool = False, device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        group = resolve_group(group)
        ffn_hidden = 4 * check_int("hidden", hidden, minimum=1) if ffn_hidden is None else ffn_hidden
        check_divisible("ffn_hidden", check_int("ffn_hidden", ffn_hidden, minimum=1), T_NAME, group_size(group))
        kw = {"group": group, "sequence_parallel": sequence_parallel, "device": device, "dtype": dtype}
        self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, bias=bias, **kw)
        self.fc2 = RowParallelLinear(ffn_hidden, hidden, bias=bias, input_is_parallel=True, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))
