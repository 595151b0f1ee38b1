"""3D-parallel training of GPT- and Llama-style models (§6): tensor × pipeline × data parallelism, checkpoints, the loop."""

from modelpar.training.config import SCHEDULE_CHOICES, TrainConfig
from modelpar.training.grads import GradSync
from modelpar.training.loop import TrainResult, lr_at
from modelpar.training.optimizer import param_groups
from modelpar.training.start import train

__all__ = [
    "SCHEDULE_CHOICES",
    "GradSync",
    "TrainConfig",
    "TrainResult",
    "lr_at",
    "param_groups",
    "train",
]
