"""Pipeline execution with torch: the threaded ``Pipe`` (one process) and the multi-process runtime."""

from modelpar.pipeline.microbatch import (
    LinearFit,
    MicrobatchRow,
    MicrobatchScan,
    fit_linear,
    measure_stage_times,
    microbatch_table,
    mlp_stage,
    optimal_microbatches,
    predicted_step_time,
)
from modelpar.pipeline.partition import balance_by_cost, balance_by_size, balance_by_time, layer_times, split_sequential
from modelpar.pipeline.pipe import Pipe
from modelpar.pipeline.workers import StageWorkers

__all__ = [
    "LinearFit",
    "MicrobatchRow",
    "MicrobatchScan",
    "Pipe",
    "StageWorkers",
    "balance_by_cost",
    "balance_by_size",
    "balance_by_time",
    "fit_linear",
    "layer_times",
    "measure_stage_times",
    "microbatch_table",
    "mlp_stage",
    "optimal_microbatches",
    "predicted_step_time",
    "split_sequential",
]
