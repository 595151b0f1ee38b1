"""Pipeline execution with torch: the threaded ``Pipe`` (one process) and the multi-process runtime."""

from modelpar.pipeline.executor import StepRecord
from modelpar.pipeline.measure import gather_timeline, measured_durations, predict
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
from modelpar.pipeline.mlp_bench import MLPBench
from modelpar.pipeline.partition import balance_by_cost, balance_by_size, balance_by_time, layer_times, split_sequential
from modelpar.pipeline.pipe import Pipe
from modelpar.pipeline.runner import PipelineRunner
from modelpar.pipeline.stage import PipelineStage
from modelpar.pipeline.stages import even_balance, mlp_model, split_stages
from modelpar.pipeline.workers import StageWorkers

__all__ = [
    "LinearFit",
    "MLPBench",
    "MicrobatchRow",
    "MicrobatchScan",
    "Pipe",
    "PipelineRunner",
    "PipelineStage",
    "StageWorkers",
    "StepRecord",
    "balance_by_cost",
    "balance_by_size",
    "balance_by_time",
    "even_balance",
    "fit_linear",
    "gather_timeline",
    "layer_times",
    "measure_stage_times",
    "measured_durations",
    "microbatch_table",
    "mlp_model",
    "mlp_stage",
    "optimal_microbatches",
    "predict",
    "predicted_step_time",
    "split_sequential",
    "split_stages",
]
