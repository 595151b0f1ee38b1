"""Pipeline execution with torch: the multi-process runtime (``PipelineRunner``) and the threaded ``Pipe``;
``measure`` turns a runner's last step into a ``Timeline`` and the measured costs."""

from modelpar.pipeline.executor import StepRecord
from modelpar.pipeline.measure import (
    Link,
    gather_timeline,
    measure_link,
    measured_durations,
    measured_timeline,
    message_bytes,
    simulate_measured,
    transfer_times,
)
from modelpar.pipeline.partition import balance_by_cost, balance_by_size, balance_by_time, layer_times, split_sequential
from modelpar.pipeline.pipe import Pipe
from modelpar.pipeline.runner import PipelineRunner
from modelpar.pipeline.stage import LocalStage
from modelpar.pipeline.stages import split_stages
from modelpar.pipeline.workers import StageWorkers

__all__ = [
    "Link",
    "LocalStage",
    "Pipe",
    "PipelineRunner",
    "StageWorkers",
    "StepRecord",
    "balance_by_cost",
    "balance_by_size",
    "balance_by_time",
    "gather_timeline",
    "layer_times",
    "measure_link",
    "measured_durations",
    "measured_timeline",
    "message_bytes",
    "simulate_measured",
    "split_sequential",
    "split_stages",
    "transfer_times",
]
