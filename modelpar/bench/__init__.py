"""Benchmark helpers, apart from the runtime: the built-in MLP, §2.4's micro-batch fit, GPipe's measured memory.

``modelpar bench ...`` and ``benchmarks/`` use them; nothing in the library depends on them.
"""

from modelpar.bench.gpipe_memory import GPipeReport, measure_gpipe
from modelpar.bench.microbatch import *  # noqa: F403
from modelpar.bench.microbatch import __all__ as _microbatch_all
from modelpar.bench.mlp import mlp_model, mlp_stage

__all__ = [*_microbatch_all, "GPipeReport", "measure_gpipe", "mlp_model", "mlp_stage"]
