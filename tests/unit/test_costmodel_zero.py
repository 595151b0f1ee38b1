"""Per-rank ZeRO figures (``modelpar.costmodel.zero_bytes``): the numbers the trainer's ``--zero`` accounting must equal,
and the planner's memory and data-parallel time built from them."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from modelpar.costmodel import (
    DEFAULT,
    ParallelConfig,
    device_params,
    dp_bytes_at_step_end,
    dp_bytes_per_microbatch,
    dp_bytes_sent,
    estimate,
    gradient_bytes,
    make_cluster,
    model_preset,
    optimizer_state_bytes,
    optimizer_state_bytes_per_param,
    training_state_bytes,
    weight_bytes,
)

GPT3 = model_preset("gpt3-175b")


def test_adamw_state_per_parameter_by_dtype():
    assert optimizer_state_bytes_per_param(2) == 12  # bf16/fp16: fp32 exp_avg, exp_avg_sq and master weights
    assert optimizer_state_bytes_per_param(4) == 8  # fp32: the two moments, no master copy
    assert optimizer_state_bytes_per_param(8) == 16  # float64 (the trainer's exactness tests)


def test_per_rank_bytes_by_hand():
    P, d = 1000, 4
    assert [optimizer_state_bytes(P, d, z, 2) for z in range(4)] == [12_000, 3_000, 3_000, 3_000]
    assert [gradient_bytes(P, d, z, 2) for z in range(4)] == [2_000, 2_000, 500, 500]
    assert [weight_bytes(P, d, z, 2) for z in range(4)] == [2_000, 2_000, 2_000, 500]
    assert optimizer_state_bytes(1001, 4, 1, 2) == 251 * 12  # the flat buffer padded to a multiple of d
    assert optimizer_state_bytes(1000, 1, 1, 8) == 16_000  # nothing to shard over d = 1


def test_data_parallel_bytes_sent_by_hand():
    P, d = 1000, 4
    assert dp_bytes_sent(P, d, 0, 2, 2) == 2 * 3 / 4 * P * 2  # ring all-reduce 2(d - 1)/d · bytes = 3000
    assert dp_bytes_sent(P, d, 1, 2, 2) == 3000  # reduce-scatter 3·250·2 + all-gather 3·250·2: the same total
    assert dp_bytes_sent(P, d, 1, 4, 2) == 3 * 250 * (4 + 2)  # fp32 gradients, bf16 parameters: 4500 < 6000
    assert dp_bytes_sent(P, d, 2, 2, 2, microbatches=5) == 3 * 250 * (5 * 2 + 2)  # a reduce-scatter per microbatch
    assert dp_bytes_sent(P, d, 3, 2, 2, microbatches=5) == 3 * 250 * 5 * (2 + 2 * 2)  # gather twice, scatter once
    assert dp_bytes_sent(P, 1, 1, 2, 2) == 0
    for z in range(4):  # the per-step total is the per-microbatch part m times and the end-of-step part once
        assert dp_bytes_sent(P, d, z, 4, 2, 3) == 3 * dp_bytes_per_microbatch(P, d, z, 4, 2) + dp_bytes_at_step_end(
            P, d, z, 4, 2)


@given(params=st.integers(1, 10**9), d=st.integers(1, 512), param_bytes=st.sampled_from([2, 4, 8]))
def test_zero1_optimizer_state_is_one_dth_up_to_the_padding(params, d, param_bytes):
    full = optimizer_state_bytes(params, d, 0, param_bytes)
    sharded = optimizer_state_bytes(params, d, 1, param_bytes)
    k = optimizer_state_bytes_per_param(param_bytes)
    assert full == params * k
    assert full / d <= sharded < full / d + k  # ⌈params/d⌉ elements: at most one element of padding
    if params % d == 0:
        assert dp_bytes_sent(params, d, 1, param_bytes, param_bytes) == pytest.approx(
            dp_bytes_sent(params, d, 0, param_bytes, param_bytes), rel=1e-12)


@pytest.mark.parametrize("call,message", [
    (lambda: optimizer_state_bytes(10, 2, 4, 2), "zero must be one of"),
    (lambda: gradient_bytes(10, 0, 1, 2), "d must be >= 1, got 0"),
    (lambda: weight_bytes(-1, 2, 3, 2), "params must be >= 0"),
    (lambda: dp_bytes_sent(10, 2, 1, 0, 2), "grad_bytes must be >= 1, got 0"),
    (lambda: dp_bytes_sent(10, 2, 3, 2, 2, microbatches=0), "microbatches must be >= 1, got 0"),
])
def test_bad_numbers_name_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_planner_data_parallel_time_uses_the_same_bytes():
    cluster = make_cluster("a100-80gb", 1024)
    for zero in (0, 1):
        cfg = ParallelConfig(8, 16, 8, zero=zero)
        e = estimate(GPT3, cluster, cfg, 1536, DEFAULT)
        params = max(device_params(GPT3, cfg, r) for r in (0, 1, 15))  # the heaviest device: the last (output)
        sent = dp_bytes_at_step_end(params, 8, zero, DEFAULT.grad_bytes, DEFAULT.param_bytes)
        # t·d = 64 ranks span nodes, one rank of the group per node: every ring byte at link_efficiency of 25 GB/s,
        # plus the collective latency and NCCL's 2·7 network hops of 14 µs (an all-reduce, or ZeRO-1's RS + AG)
        ring = sent / (25e9 * 0.85) + 20e-6 + 2 * 7 * 14e-6
        # tied word embedding: its 16-bit gradient all-reduced between the first and the last stage (2 nodes)
        table = 51200 * 12288 / 8 * 2
        sync = table / (25e9 * 0.85) + 20e-6 + 2 * 14e-6
        assert e.time["dp"] == pytest.approx(ring + sync, rel=1e-12)
        # memory: the first device (embedding, p microbatches in flight) is the most loaded
        assert e.memory["state"] == training_state_bytes(device_params(GPT3, cfg, 0), 8, zero, 2, 2)
