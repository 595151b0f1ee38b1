"""Per-rank training-state bytes and data-parallel traffic under ZeRO stage 0–3, from plain numbers.

The planner's memory and data-parallel time are built from these, and the trainer's ``--zero``
accounting must equal them for the same configuration, so they take only numbers: ``params``
is the number of parameters this rank's model part holds (its tensor- and pipeline-parallel
share, before any ZeRO sharding), ``d`` the data-parallel size, and bytes per element. A sharded
buffer holds ⌈params/d⌉ elements per rank: the flat buffer is padded to a multiple of d, as
Megatron's distributed optimizer and torch FSDP's flat parameter do.

Stages (Rajbhandari et al. 2020, ZeRO §5): 0 keeps everything on every rank; 1 shards the
optimizer state (Megatron's ``--use-distributed-optimizer``); 2 also the gradients; 3 also the
parameters (FSDP ``FULL_SHARD``), gathered layer by layer when needed.
"""

from __future__ import annotations

import math

from modelpar._validate import check_choice, check_int, check_number

__all__ = [
    "ZERO_STAGES",
    "dp_bytes_at_step_end",
    "dp_bytes_per_microbatch",
    "dp_bytes_sent",
    "gradient_bytes",
    "optimizer_state_bytes",
    "optimizer_state_bytes_per_param",
    "shard_elements",
    "training_state_bytes",
    "weight_bytes",
]

ZERO_STAGES = (0, 1, 2, 3)


def _checked(params: float, d: int, zero: int) -> tuple[float, int]:
    check_choice("zero", zero, ZERO_STAGES)
    return check_number("params", params), check_int("d", d, minimum=1)


def _held(params: float, d: int, sharded: bool) -> float:
    return float(math.ceil(params / d)) if sharded and d > 1 else params


def _adamw(param_bytes: int) -> int:
    return 12 if param_bytes < 4 else 2 * param_bytes


def shard_elements(params: float, d: int, sharded: bool) -> float:
    """Elements of a ``params``-long buffer one rank holds: ⌈params/d⌉ when ``sharded``, else all of it."""
    return _held(check_number("params", params), check_int("d", d, minimum=1), sharded)


def optimizer_state_bytes_per_param(param_bytes: int) -> int:
    """AdamW's state per parameter: exp_avg and exp_avg_sq, plus an fp32 master copy for 16-bit parameters.

    16-bit (bf16/fp16) parameters: 4 + 4 + 4 = 12 bytes, all fp32 (mixed precision, ZeRO §3.1's K = 12).
    fp32 or fp64 parameters: the two moments in the parameter's dtype, 2·param_bytes, no master copy.
    """
    return _adamw(check_int("param_bytes", param_bytes, minimum=1))


def optimizer_state_bytes(params: float, d: int, zero: int, param_bytes: int) -> float:
    """Bytes of AdamW state (moments and, for 16-bit parameters, fp32 master weights) on one rank; sharded for zero ≥ 1."""
    params, d = _checked(params, d, zero)
    return _held(params, d, zero >= 1) * optimizer_state_bytes_per_param(param_bytes)


def gradient_bytes(params: float, d: int, zero: int, grad_bytes: int) -> float:
    """Bytes of gradients on one rank: the whole buffer for zero 0 and 1, its 1/d shard for zero ≥ 2."""
    params, d = _checked(params, d, zero)
    return _held(params, d, zero >= 2) * check_int("grad_bytes", grad_bytes, minimum=1)


def weight_bytes(params: float, d: int, zero: int, param_bytes: int) -> float:
    """Bytes of the (16-bit) parameters on one rank: all of them, or their 1/d shard for zero 3 (gathered layers aside)."""
    params, d = _checked(params, d, zero)
    return _held(params, d, zero >= 3) * check_int("param_bytes", param_bytes, minimum=1)


def training_state_bytes(params: float, d: int, zero: int, param_bytes: int, grad_bytes: int) -> float:
    """Weights + gradients + AdamW state on one rank: ``weight_bytes`` + ``gradient_bytes`` + ``optimizer_state_bytes``."""
    params, d = _checked(params, d, zero)
    w, g = check_int("param_bytes", param_bytes, minimum=1), check_int("grad_bytes", grad_bytes, minimum=1)
    return _held(params, d, zero >= 3) * w + _held(params, d, zero >= 2) * g + _held(params, d, zero >= 1) * _adamw(w)


def dp_bytes_per_microbatch(params: float, d: int, zero: int, grad_bytes: int, param_bytes: int,
                            reshard_after_forward: bool = True) -> float:
    """Data-parallel bytes one rank sends for every microbatch: none for zero 0 and 1 (their gradients
    accumulate in a whole buffer); zero 2 reduce-scatters each microbatch's gradients, having nowhere to
    accumulate them; zero 3 also all-gathers the parameters for the forward and again for the backward
    (``reshard_after_forward``; without it a stage's parameters stay gathered through the step: one
    all-gather per step, counted in ``dp_bytes_at_step_end``)."""
    params, d = _checked(params, d, zero)
    g, w = check_int("grad_bytes", grad_bytes, minimum=1), check_int("param_bytes", param_bytes, minimum=1)
    if zero <= 1 or d == 1:
        return 0.0
    ring = (d - 1) * _held(params, d, True)  # elements one rank sends in an all-gather or reduce-scatter
    return ring * (g + (2 * w if zero == 3 and reshard_after_forward else 0))


def dp_bytes_at_step_end(params: float, d: int, zero: int, grad_bytes: int, param_bytes: int,
                         reshard_after_forward: bool = True) -> float:
    """Data-parallel bytes one rank sends once per step, after the last microbatch's backward.

    zero 0: the ring all-reduce of the gradients, 2(d − 1)/d · params · grad_bytes. zero 1: a
    reduce-scatter of the gradients and, after the sharded update, an all-gather of the parameters,
    (d − 1) shards each: the all-reduce's total when grad_bytes == param_bytes. zero 2: the
    parameter all-gather. zero 3: nothing (the next forward gathers what it needs), or without
    ``reshard_after_forward`` the one all-gather that keeps the parameters through the step.
    """
    params, d = _checked(params, d, zero)
    g, w = check_int("grad_bytes", grad_bytes, minimum=1), check_int("param_bytes", param_bytes, minimum=1)
    if zero == 3 and not reshard_after_forward and d > 1:
        return (d - 1) * _held(params, d, True) * w
    if d == 1 or zero == 3:
        return 0.0
    if zero == 0:
        return 2.0 * (d - 1) / d * params * g
    ring = (d - 1) * _held(params, d, True)
    return ring * (g + w) if zero == 1 else ring * w


def dp_bytes_sent(
    params: float, d: int, zero: int, grad_bytes: int, param_bytes: int, microbatches: int = 1,
    reshard_after_forward: bool = True,
) -> float:
    """Data-parallel bytes one rank sends per step with ring collectives (ZeRO §7): ``microbatches`` ×
    ``dp_bytes_per_microbatch`` + ``dp_bytes_at_step_end``.

    zero 0: 2(d − 1)/d · params · grad_bytes (all-reduce). zero 1: (d − 1)·⌈params/d⌉·(grad_bytes +
    param_bytes) (reduce-scatter + all-gather). zero 2: (d − 1)·⌈params/d⌉·(m·grad_bytes + param_bytes).
    zero 3: (d − 1)·⌈params/d⌉·m·(grad_bytes + 2·param_bytes), 1.5× the all-reduce per microbatch (ZeRO §7.2.2);
    without ``reshard_after_forward`` (d − 1)·⌈params/d⌉·(m·grad_bytes + param_bytes).
    """
    m = check_int("microbatches", microbatches, minimum=1)
    return (m * dp_bytes_per_microbatch(params, d, zero, grad_bytes, param_bytes, reshard_after_forward)
            + dp_bytes_at_step_end(params, d, zero, grad_bytes, param_bytes, reshard_after_forward))
