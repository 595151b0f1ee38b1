"""Megatron-style tensor parallelism over torch.distributed, with sequence parallelism (§5).

Layers take ``group`` (a ProcessGroup, a 1-D DeviceMesh, or None for one process) and hold
1/t of each split weight; with ``group=None`` they are the single-process reference modules
with the same parameter names and shapes. ``param_layout`` says where a shard sits in the full
tensor; ``load_full_state_dict`` / ``gather_full_state_dict`` move weights between the two;
``comm_log`` records the collectives issued inside it.
"""

from modelpar.tensor_parallel.accounting import CommLog, CommRecord, comm_log
from modelpar.tensor_parallel.attention import ParallelAttention
from modelpar.tensor_parallel.collectives import (
    SEQUENCE_DIM,
    copy_to_tensor_parallel_region,
    enter_column_parallel_region,
    exit_row_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from modelpar.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from modelpar.tensor_parallel.dropout import sliced_dropout
from modelpar.tensor_parallel.kv_cache import KVCache
from modelpar.tensor_parallel.layers import (
    ColumnParallelLinear,
    LayerNorm,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    pad_vocab_size,
)
from modelpar.tensor_parallel.mlp import ParallelMLP
from modelpar.tensor_parallel.sharding import (
    ParamLayout,
    TensorParallelModule,
    gather_full_state_dict,
    load_full_state_dict,
    param_layout,
    set_shape_checks,
    shard_state_dict,
    shard_tensor,
    sync_tensor_parallel_grads,
    unshard_tensor,
)
from modelpar.tensor_parallel.splits import matmul_splits, mlp_splits
from modelpar.tensor_parallel.transformer import ParallelTransformerLayer

__all__ = [
    "SEQUENCE_DIM",
    "ColumnParallelLinear",
    "CommLog",
    "CommRecord",
    "KVCache",
    "LayerNorm",
    "ParallelAttention",
    "ParallelMLP",
    "ParallelTransformerLayer",
    "ParamLayout",
    "RMSNorm",
    "RowParallelLinear",
    "TensorParallelModule",
    "VocabParallelEmbedding",
    "comm_log",
    "copy_to_tensor_parallel_region",
    "enter_column_parallel_region",
    "exit_row_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "gather_full_state_dict",
    "load_full_state_dict",
    "matmul_splits",
    "mlp_splits",
    "pad_vocab_size",
    "param_layout",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
    "set_shape_checks",
    "shard_state_dict",
    "shard_tensor",
    "sliced_dropout",
    "sync_tensor_parallel_grads",
    "unshard_tensor",
    "vocab_parallel_cross_entropy",
]
