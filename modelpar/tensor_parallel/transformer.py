"""A pre-norm transformer layer with Megatron tensor parallelism and optional sequence parallelism.

    x = x + Dropout(g(Attn_i(f(Norm₁(x)))))        (§5.4; Shoeybi et al. 2019, Fig. 3)
    x = x + Dropout(g(MLP_i(f(Norm₂(x)))))

f and g sit inside the column/row layers. The norms, dropout and the residual are replicated on
every rank. With ``sequence_parallel`` (Korthikanti et al. 2022, §4.2.2) they act on sequence
shards [b, s/t, h] instead: f becomes an all-gather and g a reduce-scatter along the sequence,
the same communication volume with 1/t of those activations per rank. Call
``sync_tensor_parallel_grads`` after backward to sum the norm and row-bias gradients.

GPT-2 style: LayerNorm, multi-head attention, GeLU MLP, biases. Llama style (``llama=True``):
RMSNorm, grouped-query attention with rotary positions, SwiGLU MLP, no biases.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from modelpar._validate import check_number
from modelpar.tensor_parallel._comm import group_rank, group_size, resolve_group
from modelpar.tensor_parallel.attention import ParallelAttention
from modelpar.tensor_parallel.collectives import SEQUENCE_DIM
from modelpar.tensor_parallel.context_parallel import ContextParallel
from modelpar.tensor_parallel.dropout import sliced_dropout
from modelpar.tensor_parallel.kv_cache import LayerCache
from modelpar.tensor_parallel.layers import LayerNorm, RMSNorm
from modelpar.tensor_parallel.mlp import ParallelMLP
from modelpar.tensor_parallel.rotary import Rope

__all__ = ["ParallelTransformerLayer"]


class ParallelTransformerLayer(nn.Module):
    """ln1 → attn → residual, ln2 → mlp → residual; parameter names are the same for every t.

    Input/output: [b, s, h] replicated on every rank, or this rank's sequence shard [b, s/t, h]
    with ``sequence_parallel``. ``dropout`` is applied to each branch before the residual add,
    ``attn_dropout`` to the attention probabilities; all ranks must share the random seed.
    ``llama``: Llama-style blocks with ``kv_heads`` key/value heads (default: ``heads``) and
    rotary positions of base ``rope_theta``. ``recompute_core``: selective recomputation of the
    attention core. ``context``: context parallelism (the input holds this rank's s/cp tokens).
    """

    def __init__(self, hidden: int, heads: int, ffn_hidden: int | None = None, dropout: float = 0.0,
                 attn_dropout: float = 0.0, bias: bool = True, eps: float = 1e-5, llama: bool = False,
                 kv_heads: int | None = None, rope_theta: float = 10000.0, recompute_core: bool = False,
                 group: Any = None, sequence_parallel: bool = False, device: Any = None,
                 dtype: torch.dtype | None = None, context: ContextParallel | None = None) -> None:
        super().__init__()
        group = resolve_group(group)
        self.dropout = check_number("dropout", dropout)
        if self.dropout >= 1.0:
            raise ValueError(f"dropout must be < 1, got {dropout}")
        self.sequence_parallel = sequence_parallel
        self.rank, self.world = group_rank(group), group_size(group)
        kw = {"group": group, "sequence_parallel": sequence_parallel, "device": device, "dtype": dtype}
        norm = RMSNorm if llama else LayerNorm
        bias = bias and not llama
        self.ln1 = norm(hidden, eps=eps, **kw)
        self.attn = ParallelAttention(hidden, heads, kv_heads=(kv_heads or heads) if llama else None,
                                      dropout=attn_dropout, bias=bias, rope_theta=rope_theta if llama else None,
                                      recompute_core=recompute_core, context=context, **kw)
        self.ln2 = norm(hidden, eps=eps, **kw)
        self.mlp = ParallelMLP(hidden, ffn_hidden, bias=bias, gated=llama, **kw)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # a sequence shard: draw the full-sequence mask, keep my slice
            return sliced_dropout(x, self.dropout, self.training, SEQUENCE_DIM, self.rank, self.world)
        return sliced_dropout(x, self.dropout, self.training)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None, rope: Rope | None = None) -> torch.Tensor:
        """``rope``: the rotary cos/sin of this input's positions (Llama), shared by a model's layers."""
        x = x + self._drop(self.attn(self.ln1(x), cache, rope))
        return x + self._drop(self.mlp(self.ln2(x)))
