"""Activation recomputation (reference §4.3, Chen et al. 2016): none (store all), recompute-all, every-k (√n),
and selective recomputation of attention (Korthikanti et al. 2022).

``Recompute(layers, recompute="none" | k | "sqrt" | "full" | "recompute-all")`` runs a chain of
layers keeping fewer activations and re-running them in backward, with gradients bitwise equal to
plain autograd; ``recompute_function(fn, *inputs)`` does it for one function (the attention core
of ``recompute="selective"``). ``RECOMPUTE_NAMES`` is the one vocabulary. ``ActivationMeter``
measures what autograd holds. ``HostOffload`` / ``apply_offload`` move chosen layers' saved activations
to host memory and back (``offload_plan``: which layers, pure Python).
``modelpar.recompute.strategies`` has the closed forms (chain cost,
GPipe's memory model) and imports no torch; so that the pure-Python parts can use it, this
package imports its torch modules lazily, on first use of a name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from modelpar.offload_plan import OFFLOAD_NAMES, offload_layers, parse_offload
from modelpar.recompute.strategies import (
    RECOMPUTE_NAMES,
    ChainCost,
    RecomputePlan,
    Strategy,
    best_k,
    chain_cost,
    gpipe_activation_memory,
    parse_strategy,
    plan_recompute,
)

if TYPE_CHECKING:
    from modelpar.recompute.chain_measure import (
        ChainReport,
        ScaledTanh,
        measure_chain,
        scaled_tanh_stages,
        strategy_table,
    )
    from modelpar.recompute.functions import Checkpoint, RecomputeAll, RecomputeStats, recompute_function
    from modelpar.recompute.meter import ActivationMeter, HeldActivations
    from modelpar.recompute.module import Recompute, recompute_sequential, recompute_stage
    from modelpar.recompute.offload import HostOffload, OffloadReading, apply_offload

_TORCH_NAMES = {
    "functions": ["Checkpoint", "RecomputeAll", "RecomputeStats", "recompute_function"],
    "chain_measure": ["ChainReport", "ScaledTanh", "measure_chain", "scaled_tanh_stages", "strategy_table"],
    "meter": ["ActivationMeter", "HeldActivations"],
    "module": ["Recompute", "recompute_sequential", "recompute_stage"],
    "offload": ["HostOffload", "OffloadReading", "apply_offload"],
}
_HOME = {name: module for module, names in _TORCH_NAMES.items() for name in names}

__all__ = sorted(["OFFLOAD_NAMES", "RECOMPUTE_NAMES", "ChainCost", "RecomputePlan", "Strategy", "best_k", "chain_cost",
                  "gpipe_activation_memory", "offload_layers", "parse_offload", "parse_strategy", "plan_recompute",
                  *_HOME])


def __getattr__(name: str) -> Any:
    """Import the torch half of the package when one of its names is first used."""
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
