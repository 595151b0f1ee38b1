"""Benchmark helpers, apart from the runtime: the built-in MLP, §2.4's micro-batch fit, GPipe's measured memory.

``modelpar bench ...`` and ``benchmarks/`` use them; nothing in the library depends on them.
"""

from modelpar.bench.gpipe_memory import GPipeReport, measure_gpipe
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
    "GPipeReport",
    "LinearFit",
    "MicrobatchRow",
    "MicrobatchScan",
    "fit_linear",
    "measure_gpipe",
    "measure_stage_times",
    "microbatch_table",
    "mlp_model",
    "mlp_stage",
    "optimal_microbatches",
    "predicted_step_time",
]
