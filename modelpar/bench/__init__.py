"""Benchmark helpers, apart from the runtime: the built-in MLP, §2.4's micro-batch fit, the pipeline bench.

``modelpar bench ...`` and ``benchmarks/`` use them; nothing in the library depends on them.
"""

from modelpar.bench.microbatch import (
    LinearFit,
    MicrobatchRow,
    MicrobatchScan,
    fit_linear,
    measure_stage_times,
    microbatch_table,
    optimal_microbatches,
    predicted_step_time,
)
from modelpar.bench.mlp import mlp_model, mlp_stage

__all__ = [
    "LinearFit",
    "MicrobatchRow",
    "MicrobatchScan",
    "fit_linear",
    "measure_stage_times",
    "microbatch_table",
    "mlp_model",
    "mlp_stage",
    "optimal_microbatches",
    "predicted_step_time",
]
