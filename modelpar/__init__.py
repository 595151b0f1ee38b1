"""modelpar: model parallelism in PyTorch, and the tools to reason about it.

The public surface, by task (each name also lives in the subpackage named beside it)::

    build a schedule   clock_cycles, get_schedule, Schedule, Action, Kind     modelpar.schedules
    simulate it        Costs, Timeline (and modelpar.simulate.simulate)       modelpar.simulate
    run it             Pipe (threads, one process), LocalCluster              modelpar.pipeline, .distributed
    train              TrainConfig, ModelConfig, train, run_local, TrainResult modelpar.training, .model
    plan               estimate, search, ModelSpec, ClusterSpec, ParallelConfig modelpar.costmodel

``simulate`` is not a top-level name: ``modelpar.simulate`` is the simulator's package, so the
function is ``modelpar.simulate.simulate``. The reference's call forms stay:
``clock_cycles(num_batches, num_partitions)`` and ``Pipe(stages, devices, split_size)``.

Names load on first use (PEP 562), so ``import modelpar`` and the pure-Python parts
(``modelpar.schedules``, ``modelpar.simulate``, ``modelpar.costmodel``) import nothing from torch
and the simulator and the planner start instantly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from modelpar.costmodel import ClusterSpec, ModelSpec, ParallelConfig, estimate, search
    from modelpar.distributed import LocalCluster
    from modelpar.model import ModelConfig
    from modelpar.pipeline import Pipe
    from modelpar.schedules import Action, Kind, Schedule, clock_cycles, get_schedule
    from modelpar.simulate import Costs, Timeline
    from modelpar.training import TrainConfig, TrainResult, train
    from modelpar.training.start import run_local

__version__ = "0.1.0"

_HOME = {
    "clock_cycles": "modelpar.schedules", "get_schedule": "modelpar.schedules", "Schedule": "modelpar.schedules",
    "Action": "modelpar.schedules", "Kind": "modelpar.schedules",
    "Costs": "modelpar.simulate", "Timeline": "modelpar.simulate",
    "Pipe": "modelpar.pipeline", "LocalCluster": "modelpar.distributed",
    "TrainConfig": "modelpar.training", "TrainResult": "modelpar.training", "train": "modelpar.training",
    "run_local": "modelpar.training.start", "ModelConfig": "modelpar.model",
    "estimate": "modelpar.costmodel", "search": "modelpar.costmodel", "ModelSpec": "modelpar.costmodel",
    "ClusterSpec": "modelpar.costmodel", "ParallelConfig": "modelpar.costmodel",
}

__all__ = [
    "Action", "ClusterSpec", "Costs", "Kind", "LocalCluster", "ModelConfig", "ModelSpec", "ParallelConfig", "Pipe",
    "Schedule", "Timeline", "TrainConfig", "TrainResult", "__version__", "clock_cycles", "estimate", "get_schedule",
    "run_local", "search", "train",
]


def __getattr__(name: str) -> Any:
    """Import a public name's home module when the name is first used."""
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value  # later uses skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})
