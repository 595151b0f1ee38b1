"""Closed forms the simulator must agree with (tests check simulator = formula); pure Python.

Bubbles here are "idle over step", the simulator's ``Timeline.bubble`` (docs/notation.md): GPipe's
and 1F1B's (K − 1)/(M + K − 1) and the throughput K·M/(M + K − 1) of §2.3 (slides p. 11) come from
the shared leaf ``modelpar.formulas`` under their names there; the zero-bubble idle times are Qi
et al. 2024 §3.1. Megatron's interleaved bubble, "idle over ideal compute", is
``modelpar.formulas.bubble_over_ideal_compute``.
"""

from __future__ import annotations

import math

from modelpar._validate import check_int, check_number
from modelpar.formulas import bubble_fraction_of_step, pipeline_speedup

__all__ = [
    "bubble_fraction_of_step",
    "min_microbatches_for_bubble",
    "one_f_one_b_bubble_time",
    "pipeline_speedup",
    "zb_h1_bubble_time",
]


def one_f_one_b_bubble_time(stages: int, t_f: float, t_b: float) -> float:
    """Idle time per rank of GPipe and 1F1B with no transfers: (K − 1)(t_f + t_b).

    The step is (M + K − 1)(t_f + t_b): M microbatches plus K − 1 to fill and drain (§2.3).
    """
    k = check_int("stages", stages, minimum=1)
    return (k - 1) * (check_number("t_f", t_f) + check_number("t_b", t_b))


def zb_h1_bubble_time(stages: int, t_f: float, t_b: float, t_w: float) -> float:
    """ZB-H1 idle time per rank, (K − 1)(T_F + T_B − T_W) (Qi et al. 2024 §3.1; M ≥ K).

    T_B is the input-gradient part of the backward (our I) and T_W the weight-gradient part:
    with T_F = T_B = T_W this is one third of 1F1B's (K − 1)(T_F + T_B + T_W).
    """
    k = check_int("stages", stages, minimum=1)
    return (k - 1) * (check_number("t_f", t_f) + check_number("t_b", t_b) - check_number("t_w", t_w))


def min_microbatches_for_bubble(stages: int, target: float) -> int:
    """Smallest M with (K − 1)/(M + K − 1) < target: M > (K − 1)(1/target − 1); 5% gives 19(K − 1)."""
    k = check_int("stages", stages, minimum=1)
    x = check_number("target", target, minimum=0.0, strict=True)
    if x > 1:
        raise ValueError(f"target must be a fraction in (0, 1], got {target}")
    bound = (k - 1) * (1 / x - 1)
    m = math.floor(bound) + 1
    while m > 1 and bubble_fraction_of_step(k, m - 1) < x:  # guard against rounding of 1/x
        m -= 1
    while bubble_fraction_of_step(k, m) >= x:
        m += 1
    return max(m, 1)
