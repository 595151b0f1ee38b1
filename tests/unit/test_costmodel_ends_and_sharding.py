"""The published-run pricer's terms for the pipeline's ends, sharded data parallelism and overlapped tensor
parallelism (issue 38, item 5), each checked by hand against its formula."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelpar.costmodel import DEFAULT, MODERN, REFERENCE, ParallelConfig, estimate, make_cluster, model_preset
from modelpar.costmodel.ends import CROSS_ENTROPY_BYTES, embedding_time, output_layer_time
from modelpar.costmodel.engines import engine_assumptions
from modelpar.costmodel.estimate import tp_collectives, tp_overlapped
from modelpar.costmodel.measured import layer_gemms
from modelpar.costmodel.memory import LOGIT_BYTES, end_working_bytes, memory_breakdown
from modelpar.costmodel.network import ring_time, sharded_dp_exposed
from modelpar.schedules.registry import get_schedule
from modelpar.simulate.synthesis import StageCosts

GPT3 = model_preset("gpt3-175b")
LLAMA70 = model_preset("llama3-70b")
A100 = make_cluster("a100-80gb", 1024)
H100 = make_cluster("h100-sxm", 64)


def test_output_layer_by_hand_flops_and_counted_cross_entropy_bytes():
    cfg = ParallelConfig(1, 4, 256, micro_batch=2)
    tokens, eff = 2 * 2048, 0.5
    gemm = 3 * tokens * 2 * 12288 * 51200 / (312e12 * eff)
    assert output_layer_time(GPT3, A100, cfg, DEFAULT, eff) == pytest.approx(gemm + 52 * tokens * 51200 / 2.039e12)
    assert CROSS_ENTROPY_BYTES == 52  # forward 2 + 4 + 4 + 8 + 8 + 4, backward 8 + 8 + 6
    assert output_layer_time(GPT3, A100, cfg, REFERENCE, eff) == pytest.approx(gemm)  # the text: matmuls only
    # t = 8, SP, Megatron: the forward gather of the head's input, its backward reduce-scatter hidden (tp_overlap 1),
    # and the cross entropy's three all-reduces of one fp32 value per token
    sp = ParallelConfig(8, 4, 32, micro_batch=2, sequence_parallel=True)
    one = 2 * 7 / 8 * tokens * 12288 * 2 / (300e9 * 0.85) + 20e-6
    tiny = 2 * 7 / 8 * tokens * 4 / (300e9 * 0.85) + 20e-6
    expected = gemm / 8 + 52 * tokens * 6400 / 2.039e12 + 0.5 * one + 3 * tiny
    assert output_layer_time(GPT3, A100, sp, DEFAULT, eff) == pytest.approx(expected)


def test_embedding_gradient_on_the_first_stage_by_hand():
    cfg = ParallelConfig(1, 4, 256)
    table = 51200 * 12288
    # zero the dense 16-bit gradient, then add it into the buffer: read 2, read and write 2 + 2 (DEFAULT's 16-bit grads)
    assert embedding_time(GPT3, A100, cfg, DEFAULT) == pytest.approx(table * (2 + 2 + 2 * 2) / 2.039e12)
    # an engine with an accumulation pass prices that pass for every weight already: only the zeroing here
    assert embedding_time(GPT3, A100, cfg, DEFAULT.with_(grad_accumulation_pass=True)) == pytest.approx(table * 2 / 2.039e12)
    assert embedding_time(GPT3, A100, cfg, REFERENCE) == 0.0


def test_the_ends_working_memory_on_the_first_and_last_device():
    cfg = ParallelConfig(4, 8, 32, micro_batch=2)
    logits = 2 * 2048 * 51200 / 4 * LOGIT_BYTES
    assert end_working_bytes(GPT3, cfg, 7, DEFAULT) == logits == 2 * 2048 * 12800 * 8
    assert end_working_bytes(GPT3, cfg, 0, DEFAULT) == 51200 * 12288 / 4 * 2
    assert end_working_bytes(GPT3, cfg, 3, DEFAULT) == 0.0
    assert end_working_bytes(GPT3, cfg, 7, REFERENCE) == 0.0
    one = ParallelConfig(4, 1, 256, micro_batch=2)  # one stage holds both ends
    assert end_working_bytes(GPT3, one, 0, DEFAULT) == logits + 51200 * 12288 / 4 * 2
    with_ends = memory_breakdown(GPT3, one, 4, DEFAULT)["working"]
    assert with_ends - memory_breakdown(GPT3, one, 4, DEFAULT.with_(uniform_stages=True))["working"] == pytest.approx(
        logits + 51200 * 12288 / 4 * 2)


def test_ring_time_by_hand_one_rank_per_node_inside_a_node_and_across_four_nodes():
    a, nbytes = DEFAULT, 1e9
    # t = 8: one member per node, 8 nodes: every ring byte over the network (as before), 20 µs + 7 network hops of 14 µs
    assert ring_time(nbytes, "all_gather", 8, 8, A100, a) == pytest.approx(nbytes / (25e9 * 0.85) + 20e-6 + 7 * 14e-6)
    # 8 ranks of one node: NVLink, 7 NVLink hops of 3.4 µs
    assert ring_time(nbytes, "all_gather", 8, 1, A100, a) == pytest.approx(nbytes / (300e9 * 0.85) + 20e-6 + 7 * 3.4e-6)
    # 32 ranks over 4 nodes: (N - 1)/N of the whole buffer (32/31 of the ring bytes) crosses the network per GPU;
    # an all-reduce takes 2·31 ring steps, 2·3 of them network hops
    net = 3 / 4 * nbytes * 32 / 31 / 25e9
    latency = 20e-6 + (2 * 31 - 2 * 3) * 3.4e-6 + 2 * 3 * 14e-6
    assert ring_time(nbytes, "all_reduce", 32, 1, A100, a) == pytest.approx(net / 0.85 + latency)
    assert ring_time(nbytes, "all_reduce", 32, 1, A100, REFERENCE) == pytest.approx(net)  # nominal, no latency
    # ring_node_nics: the 8 members of each node leave it through 8 NICs together
    together = a.with_(ring_node_nics=True)
    assert ring_time(nbytes, "all_reduce", 32, 1, A100, together) == pytest.approx(
        max(net / 8, nbytes / 300e9) / 0.85 + latency)
    assert ring_time(nbytes, "all_gather", 8, 8, A100, together) == ring_time(nbytes, "all_gather", 8, 8, A100, a)
    assert ring_time(0.0, "all_gather", 8, 8, A100, a) == ring_time(nbytes, "all_gather", 1, 8, A100, a) == 0.0


def test_sharded_data_parallel_hides_under_compute_but_for_the_first_gather_and_last_reduce_scatter():
    cfg = ParallelConfig(1, 1, 64, zero=3)
    params, layers = 70e9, 80
    ring = 63 * (params / layers / 64)
    ag = ring_time(ring * 2, "all_gather", 64, 1, H100, MODERN)
    rs = ring_time(ring * 4, "reduce_scatter", 64, 1, H100, MODERN)  # MODERN: fp32 gradients
    comm = layers * (2 * ag + rs)
    assert sharded_dp_exposed(layers, params, 10 * comm, cfg, H100, MODERN) == pytest.approx((0.0, ag + rs))
    assert sharded_dp_exposed(layers, params, comm / 2, cfg, H100, MODERN) == pytest.approx((comm / 2, ag + rs))
    no_overlap = MODERN.with_(dp_overlap=0.0)  # Megatron 2021: every collective exposed, per microbatch
    assert sharded_dp_exposed(layers, params, 10 * comm, cfg, H100, no_overlap) == pytest.approx((comm, 0.0))
    zero2 = dataclasses.replace(cfg, zero=2)
    assert sharded_dp_exposed(layers, params, 10 * comm, zero2, H100, MODERN) == pytest.approx((0.0, rs))
    assert sharded_dp_exposed(layers, params, 1.0, dataclasses.replace(cfg, zero=1), H100, MODERN) == (0.0, 0.0)


def test_dtensor_sequence_parallelism_has_no_regather():
    sp = ParallelConfig(8, 1, 8, recompute="none", sequence_parallel=True)
    assert tp_collectives(sp, engine_assumptions(DEFAULT, "megatron-2021")) == 5  # Megatron re-gathers, nothing hides
    assert tp_collectives(sp, engine_assumptions(DEFAULT, "pytorch")) == 4  # DTensor saves the gathered input


def test_overlapped_tensor_parallel_collectives_by_hand():
    a = engine_assumptions(MODERN, "megatron-core")
    cfg = ParallelConfig(8, 1, 8, micro_batch=1, recompute="none", sequence_parallel=True)
    tokens, eff = 8192, 0.5
    half = 7 / 8 * tokens * 8192 * 2 / (450e9 * 0.85) + 20e-6
    gemms = [2 * m * n * k / (989e12 * eff) for m, n, k in layer_gemms(LLAMA70, tokens, 8)]
    each = [max(0.0, half - g) + half / 8 for g in gemms]
    assert tp_overlapped(LLAMA70, H100, cfg, a, eff) == pytest.approx(2 * sum(each) + each[0] + each[2])
    # on the same layout, the overlapped engines are faster than their synchronous twins, and nothing else differs
    for fast, slow in (("megatron-core", "megatron"), ("pytorch-async-tp", "pytorch")):
        e_fast, e_slow = (estimate(LLAMA70, H100, cfg, 64, engine_assumptions(MODERN, n)) for n in (fast, slow))
        assert e_fast.time["tp"] < e_slow.time["tp"] and e_fast.time["compute"] == pytest.approx(e_slow.time["compute"])


@settings(max_examples=60, deadline=None)
@given(p=st.integers(2, 8), m=st.integers(1, 32), last=st.floats(0.0, 0.6), first=st.floats(0.0, 0.05))
def test_closed_form_pipeline_holds_the_simulated_1f1b_when_the_last_stage_is_the_heaviest(p, m, last, first):
    """m·T_busiest + (p − 1)·T_average (estimate's step) against the simulator on the same per-stage times (F : B
    = 1 : 2, ends on the first and last stage): never faster, and with the last stage the heaviest the simulated
    step is (m − 1)·T_busiest + Σ T_r, so the closed form exceeds it by T_busiest − T_average, no more."""
    work = [1.0] * p
    work[0] += first
    work[-1] += last
    forward = tuple(w / 3 for w in work)
    costs = StageCosts(forward, forward, forward, 0.0)
    simulated = costs.timeline(get_schedule("1f1b", ranks=p, microbatches=m, costs=costs.per_kind())).step_time
    busiest, average = max(work), sum(work) / p
    closed = m * busiest + (p - 1) * average
    assert closed >= simulated - 1e-9
    if last >= first:
        assert simulated == pytest.approx((m - 1) * busiest + sum(work), abs=1e-9)
        assert closed - simulated == pytest.approx(busiest - average, abs=1e-9)
