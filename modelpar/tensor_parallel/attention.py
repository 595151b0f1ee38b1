"""Causal multi-head self-attention split by heads (§5.3; Megatron §3, Fig. 3b).

Wqkv is column-parallel with its q, k and v blocks split separately, so rank i holds heads
[i·a/t, (i+1)·a/t) of each and attends with them alone; Wo is row-parallel and takes the
heads' outputs as its already-split input, so the block needs one all-reduce forward (g) and
one backward (f). The number of heads must be divisible by t.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from modelpar._validate import check_divisible, check_int, check_number
from modelpar.tensor_parallel._comm import group_rank, group_size, resolve_group
from modelpar.tensor_parallel.dropout import sliced_dropout
from modelpar.tensor_parallel.layers import T_NAME, ColumnParallelLinear, RowParallelLinear

__all__ = ["ParallelAttention"]


class ParallelAttention(nn.Module):
    """qkv (column, h → 3h/t, chunks = 3) → causal attention over a/t heads → proj (row, h/t → h).

    Input and output [b, s, h], or sequence shards [b, s/t, h] with ``sequence_parallel``.
    ``dropout`` acts on the attention probabilities (same mask as one process: see dropout.py).
    """

    def __init__(self, hidden: int, heads: int, dropout: float = 0.0, bias: bool = True, group: Any = None,
                 sequence_parallel: bool = False, device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        group = resolve_group(group)
        self.hidden = check_int("hidden", hidden, minimum=1)
        self.heads = check_int("heads", heads, minimum=1)
        check_divisible("hidden", hidden, "heads", heads)
        check_divisible("heads", heads, T_NAME, group_size(group))
        self.dropout = check_number("dropout", dropout)
        if self.dropout >= 1.0:
            raise ValueError(f"dropout must be < 1, got {dropout}")
        self.rank, self.world = group_rank(group), group_size(group)
        self.local_heads, self.head_dim = heads // self.world, hidden // heads
        kw = {"group": group, "sequence_parallel": sequence_parallel, "device": device, "dtype": dtype}
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, bias=bias, chunks=3, **kw)
        self.proj = RowParallelLinear(hidden, hidden, bias=bias, input_is_parallel=True, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [b, s, 3h/t] = [q_i | k_i | v_i]
        b, s = qkv.shape[0], qkv.shape[1]
        q, k, v = (u.view(b, s, self.local_heads, self.head_dim).transpose(1, 2) for u in qkv.chunk(3, dim=-1))
        p = self.dropout if self.training else 0.0
        if p == 0.0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # explicit, so the probabilities' dropout mask can be the single-process one (heads: dim 1)
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
            y = sliced_dropout(probs, p, True, dim=1, rank=self.rank, world=self.world) @ v
        return self.proj(y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))
