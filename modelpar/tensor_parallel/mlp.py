"""The Megatron MLP: Z = GeLU(X·A)·B with A split by columns and B by rows (§5.2), or SwiGLU.

Rank i computes Y_i = GeLU(X·A_i) with no communication (GeLU is element-wise, so it can act on
column blocks), then Z_i = Y_i·B_i, a partial sum; one all-reduce (g) gives Z. Splitting A by
rows instead would need an all-reduce before the GeLU: GeLU(X₁A₁ + X₂A₂) ≠ GeLU(X₁A₁) + GeLU(X₂A₂).

SwiGLU (Shazeer 2020; Llama): Z = (SiLU(X·G) ⊙ X·U)·B. G and U are fused into ``fc1`` = [G; U]
as two blocks split separately, so rank i holds G_i and U_i for the same columns and the gate
stays element-wise and local.
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

    With ``gated``: fc1 is [W_gate; W_up] (h → 2·ffn/t) and the activation SiLU(gate)·up.
    With ``sequence_parallel`` the input and output are sequence shards [b, s/t, h].
    """

    def __init__(self, hidden: int, ffn_hidden: int | None = None, bias: bool = True, gated: bool = False,
                 group: Any = None, sequence_parallel: bool = False, device: Any = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        group = resolve_group(group)
        ffn_hidden = 4 * check_int("hidden", hidden, minimum=1) if ffn_hidden is None else ffn_hidden
        check_divisible("ffn_hidden", check_int("ffn_hidden", ffn_hidden, minimum=1), T_NAME, group_size(group))
        kw = {"group": group, "sequence_parallel": sequence_parallel, "device": device, "dtype": dtype}
        self.gated = gated
        self.fc1 = ColumnParallelLinear(hidden, (2 if gated else 1) * ffn_hidden, bias=bias,
                                        blocks=2 if gated else 1, **kw)
        self.fc2 = RowParallelLinear(ffn_hidden, hidden, bias=bias, input_is_parallel=True, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)
        if self.gated:
            gate, up = y.chunk(2, dim=-1)
            return self.fc2(F.silu(gate) * up)
        return self.fc2(F.gelu(y))
