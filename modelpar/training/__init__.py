"""3D-parallel training of GPT- and Llama-style models (§6): tensor × pipeline × data parallelism, checkpoints, the loop."""

from modelpar.training.config import SCHEDULE_CHOICES, TrainConfig
from modelpar.training.grads import GradSync, all_reduce_buckets, param_groups
from modelpar.training.loop import TrainResult, lr_at, train

__all__ = [
    "SCHEDULE_CHOICES",
    "GradSync",
    "TrainConfig",
    "TrainResult",
    "all_reduce_buckets",
    "lr_at",
    "param_groups",
    "train",
]
