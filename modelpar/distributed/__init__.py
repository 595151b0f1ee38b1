"""Process start-up (local processes or torchrun) and the (pp, dp, cp, tp) process grid."""

from modelpar.distributed.launch import (
    LocalCluster,
    RankError,
    free_port,
    init_from_env,
    is_torchrun,
    launch,
    preload,
    to_launcher,
)
from modelpar.distributed.lifeline import exit_with_parent
from modelpar.distributed.mesh import ParallelDims, coordinates, rank_groups

__all__ = [
    "LocalCluster",
    "ParallelDims",
    "RankError",
    "coordinates",
    "exit_with_parent",
    "free_port",
    "init_from_env",
    "is_torchrun",
    "launch",
    "preload",
    "rank_groups",
    "to_launcher",
]
