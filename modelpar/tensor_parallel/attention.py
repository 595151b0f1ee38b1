"""Causal self-attention split by heads (§5.3; Megatron §3, Fig. 3b), multi-head or grouped-query.

Query heads are split across the t ranks: rank i holds heads [i·a/t, (i+1)·a/t) and attends with
them alone; Wo is row-parallel and takes the heads' outputs as its already-split input, so the
block needs one all-reduce forward (g) and one backward (f). Two layouts:

- multi-head (``kv_heads=None``, GPT-2): one fused ``qkv`` = [Wq; Wk; Wv], each block split by heads;
- grouped-query (``kv_heads`` = g, Llama; Ainslie et al. 2023): ``q`` and a fused ``kv`` = [Wk; Wv]
  behind one shared f. Query head j uses key/value head j // (a/g). With g ≥ t the g heads are
  split across ranks like the queries; with t > g (t divisible by g) each key/value head is
  replicated on the t/g consecutive ranks whose query heads use it, and its gradient, computed
  by each replica from its own query heads only, is summed over them (``sync_tensor_parallel_grads``).

Options: rotary position embedding (``rope_theta``), a KV cache for decoding (``cache``) and
selective recomputation (``recompute_core``: keep q, k, v and re-run QKᵀ, softmax, dropout and ·V
in backward — Korthikanti et al. 2022 §5). With ``context`` (context parallelism over cp > 1 ranks)
the input holds this rank's s/cp tokens of every sequence, in the zig-zag order of
``modelpar.tensor_parallel.context_parallel``, and the core attends over the whole sequence.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from modelpar._validate import check_divisible, check_int, check_number
from modelpar.tensor_parallel._comm import group_rank, group_size, resolve_group
from modelpar.tensor_parallel.collectives import enter_column_parallel_region
from modelpar.tensor_parallel.context_parallel import ContextParallel
from modelpar.tensor_parallel.dropout import sliced_dropout
from modelpar.tensor_parallel.kv_cache import LayerCache
from modelpar.tensor_parallel.layers import T_NAME, ColumnParallelLinear, RowParallelLinear
from modelpar.tensor_parallel.rotary import Rope, RotaryTable, apply_rotary

__all__ = ["ParallelAttention", "kv_layout", "rope_of"]


def kv_layout(kv_heads: int, t: int) -> tuple[int, int]:
    """(key/value heads per rank, ranks holding each) for ``kv_heads`` heads over t ranks."""
    check_int("kv_heads", kv_heads, minimum=1)
    if kv_heads % t and t % kv_heads:
        raise ValueError(f"kv_heads ({kv_heads}) and the tensor-parallel size t ({t}) must divide one another "
                         "(split the key/value heads when kv_heads >= t, replicate them when t > kv_heads)")
    return max(1, kv_heads // t), max(1, t // kv_heads)


class ParallelAttention(nn.Module):
    """q, k, v (column-parallel) → causal attention over a/t heads → proj (row, h/t → h).

    Input and output [b, s, h], or sequence shards [b, s/t, h] with ``sequence_parallel``.
    ``dropout`` acts on the attention probabilities (same mask as one process: see dropout.py).
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int | None = None, dropout: float = 0.0,
                 bias: bool = True, rope_theta: float | None = None, recompute_core: bool = False,
                 group: Any = None, sequence_parallel: bool = False, device: Any = None,
                 dtype: torch.dtype | None = None, context: ContextParallel | None = None) -> None:
        super().__init__()
        group = resolve_group(group)
        self.context = context if context is not None and context.size > 1 else None
        if self.context is not None and dropout:
            raise ValueError(f"dropout must be 0 with context parallelism (cp = {self.context.size}), got "
                             f"{dropout}: the attention probabilities are never formed whole")
        self.hidden = check_int("hidden", hidden, minimum=1)
        self.heads = check_int("heads", heads, minimum=1)
        check_divisible("hidden", hidden, "heads", heads)
        check_divisible("heads", heads, T_NAME, group_size(group))
        self.dropout = check_number("dropout", dropout)
        if self.dropout >= 1.0:
            raise ValueError(f"dropout must be < 1, got {dropout}")
        self.rope_theta = None if rope_theta is None else check_number("rope_theta", rope_theta, strict=True)
        self.rotary = None if self.rope_theta is None else RotaryTable(hidden // heads, self.rope_theta)
        self.recompute_core, self.sequence_parallel, self.group = recompute_core, sequence_parallel, group
        self.rank, self.world = group_rank(group), group_size(group)
        self.local_heads, self.head_dim = heads // self.world, hidden // heads
        kw = {"group": group, "sequence_parallel": sequence_parallel, "device": device, "dtype": dtype}
        self.qkv: ColumnParallelLinear | None = None
        self.q: ColumnParallelLinear | None = None
        self.kv: ColumnParallelLinear | None = None
        if kv_heads is None:
            self.local_kv_heads = self.local_heads
            self.qkv = ColumnParallelLinear(hidden, 3 * hidden, bias=bias, blocks=3, **kw)
        else:
            check_divisible("heads", heads, "kv_heads", check_int("kv_heads", kv_heads, minimum=1))
            self.local_kv_heads, replicas = kv_layout(kv_heads, self.world)
            self.q = ColumnParallelLinear(hidden, hidden, bias=bias, input_collective=False, **kw)
            self.kv = ColumnParallelLinear(hidden, 2 * kv_heads * self.head_dim, bias=bias, blocks=2,
                                           replicas=replicas, input_collective=False, **kw)
        self.proj = RowParallelLinear(hidden, hidden, bias=bias, input_is_parallel=True, **kw)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's q [b, s, a/t·d], k and v [b, s, g/t·d] (one f or ḡ in front of all three)."""
        if self.qkv is not None:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return q, k, v
        assert self.q is not None and self.kv is not None
        x = enter_column_parallel_region(x, self.group, self.sequence_parallel, self.q.check_shapes)
        k, v = self.kv(x).chunk(2, dim=-1)
        return self.q(x), k, v

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None, rope: Rope | None = None) -> torch.Tensor:
        """``rope``: the cos/sin of this input's positions, shared by a model's layers (``Transformer``);
        None: from this layer's own table."""
        q, k, v = self._project(x)
        b, s = q.shape[0], q.shape[1]
        q = q.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)  # [b, a/t, s, d]
        k, v = (u.view(b, s, self.local_kv_heads, self.head_dim).transpose(1, 2) for u in (k, v))
        if self.context is not None and cache is not None:
            raise ValueError("a KV cache (decoding) needs the whole sequence on one rank: context parallelism "
                             "is for training")
        if self.rotary is not None:
            if rope is None:
                rope = rope_of(self.rotary, 0 if cache is None else cache.pos, s, q.device, q.dtype, self.context)
            cos, sin = rope
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v)
        if self.recompute_core and torch.is_grad_enabled():
            from modelpar.recompute import recompute_function

            y = recompute_function(self.core, q, k, v)
        else:
            y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q·kᵀ/√d, causal)·v for this rank's heads; q's s positions are the last of k's.

        Grouped-query heads share their key/value head inside SDPA (``enable_gqa``: no copies).
        This is the part selective recomputation re-runs: its s² scores and probabilities are never kept.
        Context-parallel: over the cp ranks' keys and values (``ContextParallel.attend``).
        """
        if self.context is not None:
            return self.context.attend(q, k, v)
        s_q, s_k = q.shape[2], k.shape[2]
        gqa = self.local_heads != k.shape[1]
        p = self.dropout if self.training else 0.0
        if p == 0.0:
            if s_q == s_k:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=_causal(s_q, s_k, q.device), enable_gqa=gqa)
        # explicit, so the probabilities' dropout mask can be the single-process one (heads: dim 1)
        if gqa:
            k, v = (u.repeat_interleave(self.local_heads // k.shape[1], dim=1) for u in (k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        probs = scores.masked_fill(~_causal(s_q, s_k, q.device), float("-inf")).softmax(dim=-1)
        return sliced_dropout(probs, p, True, dim=1, rank=self.rank, world=self.world) @ v


def rope_of(table: RotaryTable, start: int, s: int, device: torch.device, dtype: torch.dtype,
            context: ContextParallel | None) -> Rope:
    """cos/sin of s tokens starting at ``start``, or of this rank's zig-zag positions under context parallelism."""
    if context is None:
        return table.span(start, s, device, dtype)
    return table.gather(context.positions(s, device), s * context.size, dtype)


def _causal(s_q: int, s_k: int, device: torch.device) -> torch.Tensor:
    """[s_q, s_k] True where query i (position s_k − s_q + i) may attend to key j."""
    return torch.ones(s_q, s_k, dtype=torch.bool, device=device).tril(s_k - s_q)
