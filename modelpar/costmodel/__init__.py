"""Cost model and 3D-parallel planner (pure Python, no torch).

``modelpar.formulas`` (re-exported here) holds the closed forms the reference text quotes and
``zero`` the per-rank ZeRO figures, both plain numbers in; ``specs`` and ``presets`` describe a
model and a cluster, ``profiles`` a machine (measured by ``modelpar calibrate``, or a data sheet),
``stages`` splits the layers over the pipeline, ``engines`` names each engine's overheads;
``estimate`` predicts one layout's step time, memory and throughput under named ``assumptions``;
``search`` ranks every layout; ``request`` reads a ``modelpar plan`` command line; ``published``
checks the planner against real runs given as such command lines.
"""

from modelpar.costmodel.assumptions import DEFAULT, MODERN, REFERENCE, Assumptions, assumptions_for
from modelpar.costmodel.engines import ENGINES, Engine, engine_assumptions
from modelpar.costmodel.estimate import Estimate, check_config, estimate, matmul_efficiency
from modelpar.costmodel.memory import (
    activation_bytes_per_layer,
    device_params,
    layerwise_stage_gb,
    memory_breakdown,
    stages_needed,
)
from modelpar.costmodel.presets import (
    GPUS,
    MODELS,
    PROFILES,
    NodePreset,
    gpu_preset,
    make_cluster,
    model_preset,
    profile_node,
)
from modelpar.costmodel.profiles import HardwareProfile, load_profile, save_profile
from modelpar.costmodel.search import SearchResult, chunk_counts, fitting_gpu_counts, search
from modelpar.costmodel.specs import PLANNED_RECOMPUTE, ClusterSpec, GPUSpec, ModelSpec, ParallelConfig
from modelpar.costmodel.stages import rank_layers, split_layers
from modelpar.costmodel.zero_bytes import (
    ZERO_STAGES,
    dp_bytes_at_step_end,
    dp_bytes_per_microbatch,
    dp_bytes_sent,
    gradient_bytes,
    optimizer_state_bytes,
    optimizer_state_bytes_per_param,
    shard_elements,
    training_state_bytes,
    weight_bytes,
)
from modelpar.formulas import (
    allgather_bytes,
    allreduce_bytes,
    bandwidth_demand,
    bubble_fraction_of_step,
    bubble_over_ideal_compute,
    fused_cross_entropy_bytes,
    gpt_params,
    logits_allgather_bytes,
    megatron_flops,
    pipeline_speedup,
    tp_comm_compute_ratio,
    tp_layer_comm_bytes,
    tp_layer_flops,
)

__all__ = [
    "DEFAULT",
    "ENGINES",
    "GPUS",
    "MODELS",
    "MODERN",
    "PLANNED_RECOMPUTE",
    "PROFILES",
    "REFERENCE",
    "ZERO_STAGES",
    "Assumptions",
    "ClusterSpec",
    "Engine",
    "Estimate",
    "GPUSpec",
    "HardwareProfile",
    "ModelSpec",
    "NodePreset",
    "ParallelConfig",
    "SearchResult",
    "activation_bytes_per_layer",
    "allgather_bytes",
    "allreduce_bytes",
    "assumptions_for",
    "bandwidth_demand",
    "bubble_fraction_of_step",
    "bubble_over_ideal_compute",
    "check_config",
    "chunk_counts",
    "device_params",
    "dp_bytes_at_step_end",
    "dp_bytes_per_microbatch",
    "dp_bytes_sent",
    "engine_assumptions",
    "estimate",
    "fitting_gpu_counts",
    "fused_cross_entropy_bytes",
    "gpt_params",
    "gpu_preset",
    "gradient_bytes",
    "layerwise_stage_gb",
    "load_profile",
    "logits_allgather_bytes",
    "make_cluster",
    "matmul_efficiency",
    "megatron_flops",
    "memory_breakdown",
    "model_preset",
    "optimizer_state_bytes",
    "optimizer_state_bytes_per_param",
    "pipeline_speedup",
    "profile_node",
    "rank_layers",
    "save_profile",
    "search",
    "shard_elements",
    "split_layers",
    "stages_needed",
    "tp_comm_compute_ratio",
    "tp_layer_comm_bytes",
    "tp_layer_flops",
    "training_state_bytes",
    "weight_bytes",
]
