"""Megatron's parallel layers (Shoeybi et al. 2019 §3; reference §5.1–5.5).

``ColumnParallelLinear`` splits Y = X·A by the columns of A (rank i holds A_i, computes X·A_i);
``RowParallelLinear`` splits A by rows and X by columns (rank i computes X_i·A_i, a partial sum,
and g adds them up; the bias is added once, after the sum). ``VocabParallelEmbedding`` splits
the vocabulary (rank i looks up only its ids, zeros elsewhere, then g). ``LayerNorm`` is the
replicated LayerNorm, marked so that sequence parallelism sums its gradients.

Weights use ``nn.Linear``/``nn.Embedding`` layouts and names, so with ``group=None`` (t = 1)
these layers are drop-in single-process references with the same state dict.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from modelpar._validate import check_divisible, check_int
from modelpar.tensor_parallel import collectives as C
from modelpar.tensor_parallel._comm import check_same_shape
from modelpar.tensor_parallel.sharding import ShardSpec, TensorParallelModule

__all__ = ["ColumnParallelLinear", "LayerNorm", "RowParallelLinear", "VocabParallelEmbedding", "pad_vocab_size"]

T_NAME = "the tensor-parallel size t"


class ColumnParallelLinear(TensorParallelModule):
    """Y = X·A + b with A split by columns: this rank holds ``out_features / t`` outputs.

    Input: the full X, replicated (f in front: identity forward, all-reduce backward), or with
    ``sequence_parallel`` this rank's sequence shard [b, s/t, in] (all-gathered first).
    Output: this rank's columns [..., out/t], or all of them with ``gather_output``.
    ``chunks`` = 3 for a fused [Wq; Wk; Wv]: each block is split separately, so a rank holds
    whole heads of q, k and v.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 group: Any = None, sequence_parallel: bool = False, chunks: int = 1,
                 device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self._init_tensor_parallel(group)
        self.in_features = check_int("in_features", in_features, minimum=1)
        self.out_features = check_int("out_features", out_features, minimum=1)
        chunks = check_int("chunks", chunks, minimum=1)
        check_divisible("out_features", out_features, f"chunks * t = {chunks} * {self.tp_world}" if chunks > 1
                        else T_NAME, chunks * self.tp_world)
        if gather_output and chunks > 1:
            raise ValueError("gather_output=True needs chunks=1 (gathered fused blocks would interleave)")
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features // self.tp_world, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features // self.tp_world, **factory)) if bias else None
        self._set_spec("weight", ShardSpec(0, chunks))
        self._set_spec("bias", ShardSpec(0, chunks))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's U(−1/√in, 1/√in) on this shard (for a t-independent init use ``shard_tensor``)."""
        _uniform_init(self.weight, self.bias, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = C.gather_from_sequence_parallel_region(x, self.group)
        else:
            x = C.copy_to_tensor_parallel_region(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return C.gather_from_tensor_parallel_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (/{self.tp_world}), "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(TensorParallelModule):
    """Y = X·A + b with A split by rows: this rank holds ``in_features / t`` inputs.

    Input: this rank's columns X_i [..., in/t] (``input_is_parallel``, the output of a column
    layer), or the full X, which is then split. Output: g(X_i·A_i) + b, the full Y; with
    ``sequence_parallel`` the partial sums are reduce-scattered along the sequence instead and
    the output is this rank's shard [b, s/t, out]. The bias is added once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 group: Any = None, sequence_parallel: bool = False,
                 device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self._init_tensor_parallel(group)
        self.in_features = check_int("in_features", in_features, minimum=1)
        self.out_features = check_int("out_features", out_features, minimum=1)
        check_divisible("in_features", in_features, T_NAME, self.tp_world)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel=True needs input_is_parallel=True (as in Megatron)")
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, in_features // self.tp_world, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self._set_spec("weight", ShardSpec(1))
        self._set_spec("bias", ShardSpec(None, sequence_parallel=sequence_parallel))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's U(−1/√in, 1/√in) with the full fan-in ``in_features``."""
        _uniform_init(self.weight, self.bias, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = C.scatter_to_tensor_parallel_region(x, self.group)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = C.reduce_scatter_to_sequence_parallel_region(y, self.group)
        else:
            y = C.reduce_from_tensor_parallel_region(y, self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (/{self.tp_world}), out_features={self.out_features}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


def pad_vocab_size(vocab_size: int, t: int, multiple: int = 1) -> int:
    """The smallest size ≥ ``vocab_size`` divisible by t·multiple (Megatron pads with multiple = 128)."""
    step = check_int("t", t, minimum=1) * check_int("multiple", multiple, minimum=1)
    return -(-check_int("vocab_size", vocab_size, minimum=1) // step) * step


class VocabParallelEmbedding(TensorParallelModule):
    """Embedding table split by vocabulary (§5.5): this rank holds ids [r·V/t, (r+1)·V/t).

    Each rank looks up the ids in its range, writes zeros for the others, and g sums the t
    partial lookups (with ``sequence_parallel``: reduce-scatter to [b, s/t, h] instead).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Any = None,
                 sequence_parallel: bool = False, device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self._init_tensor_parallel(group)
        self.num_embeddings = check_int("num_embeddings", num_embeddings, minimum=1)
        self.embedding_dim = check_int("embedding_dim", embedding_dim, minimum=1)
        if num_embeddings % self.tp_world:
            raise ValueError(f"num_embeddings ({num_embeddings}) must be divisible by {T_NAME} ({self.tp_world}); "
                             f"pad the vocabulary as Megatron does: pad_vocab_size({num_embeddings}, "
                             f"{self.tp_world}) = {pad_vocab_size(num_embeddings, self.tp_world)}")
        self.sequence_parallel = sequence_parallel
        self.per_rank = num_embeddings // self.tp_world
        self.vocab_start = self.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim, device=device, dtype=dtype))
        self._set_spec("weight", ShardSpec(0))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_same_shape(ids, self.group, "ids", token_ids_error("ids", ids, self.num_embeddings))
        if self.tp_world == 1:
            out = F.embedding(ids, self.weight)
            return C.scatter_to_sequence_parallel_region(out, self.group) if self.sequence_parallel else out
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.per_rank)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return C.reduce_scatter_to_sequence_parallel_region(out, self.group)
        return C.reduce_from_tensor_parallel_region(out, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} (/{self.tp_world}), {self.embedding_dim}"


class LayerNorm(nn.LayerNorm, TensorParallelModule):
    """``nn.LayerNorm``, replicated on every rank (§5.4). With ``sequence_parallel`` it normalises
    a sequence shard, so γ and β are marked for ``sync_sequence_parallel_grads``."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, group: Any = None,
                 sequence_parallel: bool = False, device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(normalized_shape, eps=eps, device=device, dtype=dtype)
        self._init_tensor_parallel(group)
        self.sequence_parallel = sequence_parallel
        for name in ("weight", "bias"):
            self._set_spec(name, ShardSpec(None, sequence_parallel=sequence_parallel))


def token_ids_error(name: str, ids: torch.Tensor, vocab: int, ignore_index: int | None = None) -> str | None:
    """The error message if some id is outside [0, vocab) (and not ``ignore_index``), else None."""
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        return f"{name} must be an integer tensor, got dtype {ids.dtype}"
    bad = (ids < 0) | (ids >= vocab)
    if ignore_index is not None:
        bad &= ids != ignore_index
    if ids.numel() and bool(bad.any()):
        value = ids[bad].flatten()[0].item()
        allowed = f"[0, {vocab})" + (f" or {ignore_index}" if ignore_index is not None else "")
        return f"{name} must be in {allowed}, got {value}"
    return None


def _uniform_init(weight: nn.Parameter, bias: nn.Parameter | None, fan_in: int) -> None:
    bound = 1.0 / math.sqrt(fan_in)
    nn.init.uniform_(weight, -bound, bound)
    if bias is not None:
        nn.init.uniform_(bias, -bound, bound)
