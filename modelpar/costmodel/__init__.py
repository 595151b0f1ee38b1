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
from modelpar.costmodel.search import SearchResult, chunk_counts, divisors, fitting_gpu_counts, search
from modelpar.costmodel.specs import PLANNED_RECOMPUTE, ClusterSpec, GPUSpec, ModelSpec, ParallelConfig
from modelpar.costmodel.stages import device_layers, split_layers
from modelpar.costmodel.zero import *  # noqa: F403
from modelpar.costmodel.zero import __all__ as _zero_all
from modelpar.formulas import *  # noqa: F403
from modelpar.formulas import __all__ as _formulas_all

__all__ = [
    *_formulas_all,
    *_zero_all,
    "Assumptions", "ClusterSpec", "HardwareProfile", "PROFILES", "load_profile", "profile_node", "save_profile",
    "DEFAULT", "ENGINES", "Engine", "Estimate", "GPUS", "GPUSpec", "MODELS", "MODERN",
    "ModelSpec", "NodePreset", "ParallelConfig", "PLANNED_RECOMPUTE", "REFERENCE", "SearchResult",
    "activation_bytes_per_layer", "assumptions_for", "check_config", "chunk_counts", "device_layers", "device_params", "divisors",
    "engine_assumptions", "estimate", "fitting_gpu_counts", "gpu_preset", "layerwise_stage_gb", "make_cluster",
    "matmul_efficiency", "memory_breakdown", "model_preset", "search", "split_layers", "stages_needed",
]
