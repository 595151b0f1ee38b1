"""Megatron's parallel layers (Shoeybi et al. 2019 §3; reference §5.1–5.5).

``ColumnParallelLinear`` splits Y = X·A by the columns of A (rank i holds A_i, computes X·A_i);
``RowParallelLinear`` splits A by rows and X by columns (rank i computes X_i·A_i, a partial sum,
and g adds them up; the bias is added once, after the sum). ``VocabParallelEmbedding`` splits
the vocabulary (rank i looks up only its ids, zeros elsewhere, then g). ``LayerNorm`` and
``RMSNorm`` are replicated, marked so that sequence parallelism sums their gradients.

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
from modelpar.tensor_parallel.sharding import TensorParallelModule

__all__ = ["ColumnParallelLinear", "LayerNorm", "RMSNorm", "RowParallelLinear", "VocabParallelEmbedding", "pad_vocab_size"]

T_NAME = "the tensor-parallel size t"


class _LocalMatmul:
    """The local product of a parallel linear layer: ``F.linear``, or a module put in its place (``use_matmul``:
    ``--precision fp8``'s ``Float8Linear`` around this layer's own weight). Kept outside the module tree, so the
    state dict and the parameters are the layer's alone."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def use_matmul(self, matmul: nn.Module) -> None:
        """Compute x·Wᵀ with ``matmul(x)`` from now on (the bias is still added here)."""
        self.__dict__["matmul"] = matmul

    def _matmul(self, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        b = self.bias if bias else None
        matmul = self.__dict__.get("matmul")
        if matmul is None:
            return F.linear(x, self.weight, b)
        y = matmul(x)
        return y + b.to(y.dtype) if b is not None else y


class ColumnParallelLinear(_LocalMatmul, TensorParallelModule):
    """Y = X·A + b with A split by columns: this rank holds ``out_features / t`` outputs.

    Input: the full X, replicated (f in front: identity forward, all-reduce backward), or with
    ``sequence_parallel`` this rank's sequence shard [b, s/t, in] (all-gathered first); with
    ``input_collective=False`` the caller has applied f / ḡ already (``enter_column_parallel_region``),
    so several column layers reading one input share it. Output: this rank's columns [..., out/t],
    or all of them with ``gather_output``.
    ``blocks`` = 3 for a fused [Wq; Wk; Wv]: each block is split separately, so a rank holds
    whole heads of q, k and v. ``replicas`` = r: only t/r distinct shards, each held by r
    consecutive ranks (key/value heads of grouped-query attention when t exceeds them).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 group: Any = None, sequence_parallel: bool = False, blocks: int = 1, replicas: int = 1,
                 input_collective: bool = True, device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self._init_tensor_parallel(group)
        self.in_features = check_int("in_features", in_features, minimum=1)
        self.out_features = check_int("out_features", out_features, minimum=1)
        blocks = check_int("blocks", blocks, minimum=1)
        replicas = check_int("replicas", replicas, minimum=1)
        check_divisible(T_NAME, self.tp_world, "replicas", replicas)
        shards = self.tp_world // replicas
        check_divisible("out_features", out_features, f"blocks * shards = {blocks} * {shards}"
                        if blocks > 1 or replicas > 1 else T_NAME, blocks * shards)
        if gather_output and (blocks > 1 or replicas > 1):
            raise ValueError("gather_output=True needs blocks=1 and replicas=1 (gathered shards would interleave)")
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.input_collective = input_collective
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features // shards, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features // shards, **factory)) if bias else None
        self._set_layout("weight", 0, blocks, replicas)
        self._set_layout("bias", 0, blocks, replicas)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's U(−1/√in, 1/√in) on this shard (for a t-independent init use ``ParamLayout.shard_of``)."""
        _uniform_init(self.weight, self.bias, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_collective:
            x = C.enter_column_parallel_region(x, self.group, self.sequence_parallel, self.check_shapes)
        y = self._matmul(x)
        return C.gather_from_tensor_parallel_region(y, self.group, self.check_shapes) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (/{self.tp_world}), "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(_LocalMatmul, TensorParallelModule):
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
        self._set_layout("weight", 1)
        self._set_layout("bias", None, sequence_parallel=sequence_parallel)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's U(−1/√in, 1/√in) with the full fan-in ``in_features``."""
        _uniform_init(self.weight, self.bias, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = C.scatter_to_tensor_parallel_region(x, self.group)
        y = C.exit_row_parallel_region(self._matmul(x, bias=False), self.group, self.sequence_parallel,
                                       self.check_shapes)
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
    ``vocab_size``: the ids a tokenizer produces when the table is padded beyond them
    (default ``num_embeddings``); larger ids are refused like ids past the table, while
    ``check_shapes`` is on (the check reads the ids on the host, a device sync, so a training loop
    turns it off after its first step, a table of one rank after its first call, and the data side
    validates each batch where it is made: ``modelpar.text.Corpus.batch``).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Any = None,
                 sequence_parallel: bool = False, vocab_size: int | None = None, device: Any = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self._init_tensor_parallel(group)
        self.num_embeddings = check_int("num_embeddings", num_embeddings, minimum=1)
        self.embedding_dim = check_int("embedding_dim", embedding_dim, minimum=1)
        self.vocab_size = num_embeddings if vocab_size is None else check_int("vocab_size", vocab_size, 1, num_embeddings)
        if num_embeddings % self.tp_world:
            raise ValueError(f"num_embeddings ({num_embeddings}) must be divisible by {T_NAME} ({self.tp_world}); "
                             f"pad the vocabulary as Megatron does: pad_vocab_size({num_embeddings}, "
                             f"{self.tp_world}) = {pad_vocab_size(num_embeddings, self.tp_world)}")
        self.sequence_parallel = sequence_parallel
        self.per_rank = num_embeddings // self.tp_world
        self.vocab_start = self.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim, device=device, dtype=dtype))
        self._set_layout("weight", 0)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)

    @property
    def reads_host(self) -> bool:
        """The ids are checked on the host while ``check_shapes`` is on, on one rank too (its first call)."""
        return self.check_shapes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.check_shapes:  # reads the ids on the host: a device sync, so only while checks are on
            check_same_shape(ids, self.group, "ids", token_ids_error("ids", ids, self.vocab_size), True)
            self.check_shapes = self.tp_world > 1  # one rank: checked once (no shapes to agree on; batches are
            #                                        validated where they are made, Corpus.batch)
        elif ids.dtype not in TOKEN_DTYPES:
            raise ValueError(f"ids must be an integer tensor, got dtype {ids.dtype}")
        if self.tp_world == 1:
            out = F.embedding(ids, self.weight)
            return C.scatter_to_sequence_parallel_region(out, self.group) if self.sequence_parallel else out
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.per_rank)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return C.exit_row_parallel_region(out, self.group, self.sequence_parallel, self.check_shapes)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} (/{self.tp_world}), {self.embedding_dim}"


class LayerNorm(nn.LayerNorm, TensorParallelModule):
    """``nn.LayerNorm``, replicated on every rank (§5.4). With ``sequence_parallel`` it normalises
    a sequence shard, so γ and β are marked for ``sync_tensor_parallel_grads``."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, group: Any = None,
                 sequence_parallel: bool = False, device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(normalized_shape, eps=eps, device=device, dtype=dtype)
        self._init_tensor_parallel(group)
        self.sequence_parallel = sequence_parallel
        for name in ("weight", "bias"):
            self._set_layout(name, None, sequence_parallel=sequence_parallel)


class RMSNorm(nn.RMSNorm, TensorParallelModule):
    """``nn.RMSNorm`` (Zhang & Sennrich 2019; Llama): x / √(mean(x²) + ε) · γ, no mean, no β.

    Replicated like ``LayerNorm``; γ is marked for ``sync_tensor_parallel_grads`` under sequence
    parallelism. torch's fused kernel (``F.rms_norm``) computes the statistics in float32 for 16-bit
    inputs, as Hugging Face's Llama does.
    """

    def __init__(self, normalized_shape: int, eps: float = 1e-6, group: Any = None,
                 sequence_parallel: bool = False, device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(normalized_shape, eps=eps, device=device, dtype=dtype)
        self._init_tensor_parallel(group)
        self.sequence_parallel = sequence_parallel
        self._set_layout("weight", None, sequence_parallel=sequence_parallel)


TOKEN_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


def token_ids_error(name: str, ids: torch.Tensor, vocab: int, ignore_index: int | None = None) -> str | None:
    """The error message if some id is outside [0, vocab) (and not ``ignore_index``), else None.

    Reads the ids on the host (a device sync): call it only where checks are asked for.
    """
    if ids.dtype not in TOKEN_DTYPES:
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
