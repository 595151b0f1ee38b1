"""Cost model and 3D-parallel planner (pure Python, no torch).

``formulas`` holds the closed forms the reference text quotes; ``specs`` and ``presets`` describe
a model and a cluster; ``estimate`` predicts one layout's step time, memory and throughput under
named ``assumptions``; ``search`` ranks every layout; ``published`` checks it against real runs.
"""

from modelpar.costmodel.assumptions import DEFAULT, MODERN, REFERENCE, Assumptions, assumptions_for
from modelpar.costmodel.estimate import Estimate, check_config, estimate, matmul_efficiency
from modelpar.costmodel.formulas import *  # noqa: F403
from modelpar.costmodel.formulas import __all__ as _formulas_all
from modelpar.costmodel.memory import (
    activation_bytes_per_layer,
    layerwise_stage_gb,
    memory_breakdown,
    params_on_gpu,
    stages_needed,
)
from modelpar.costmodel.presets import GPUS, MODELS, NodePreset, gpu_preset, make_cluster, model_preset
from modelpar.costmodel.search import SearchResult, divisors, fitting_gpu_counts, plan, search
from modelpar.costmodel.specs import RECOMPUTE, ClusterSpec, GPUSpec, ModelSpec, ParallelConfig

__all__ = [
    *_formulas_all,
    "Assumptions", "ClusterSpec", "DEFAULT", "MODERN", "assumptions_for", "Estimate", "GPUS", "GPUSpec", "MODELS", "ModelSpec",
    "NodePreset", "ParallelConfig", "RECOMPUTE", "REFERENCE", "SearchResult", "activation_bytes_per_layer",
    "check_config", "divisors", "estimate", "fitting_gpu_counts", "gpu_preset", "make_cluster",
    "layerwise_stage_gb", "matmul_efficiency", "memory_breakdown", "model_preset", "params_on_gpu", "plan", "search",
    "stages_needed",
]
