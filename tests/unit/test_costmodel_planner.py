"""§6.2 and §6.3 of the reference with its own model (REFERENCE), the search, and the estimate's pieces."""

import math

import pytest

from modelpar.costmodel import (
    DEFAULT,
    REFERENCE,
    ClusterSpec,
    ParallelConfig,
    engine_assumptions,
    estimate,
    gpu_preset,
    make_cluster,
    model_preset,
    search,
)
from modelpar.costmodel.estimate import tp_collectives

ONE_T = model_preset("megatron-1t")
GPT3 = model_preset("gpt3-175b")
CLUSTER_1T = make_cluster("a100-80gb", 3072)
CLUSTER_175 = make_cluster("a100-80gb", 1024)


@pytest.fixture(scope="module")
def one_t_text_search():
    # the text's search: its model, full recomputation, plain 1F1B, no sequence parallelism, no ZeRO
    return search(ONE_T, CLUSTER_1T, 3072, REFERENCE, v=1, recompute="full", sequence_parallel=False, zero=0)


def test_6_2_search_picks_t8(one_t_text_search):
    assert one_t_text_search.ranked[0].config.t == 8
    assert search(ONE_T, CLUSTER_1T, 3072, DEFAULT).ranked[0].config.t == 8  # also with everything searched


def test_6_2_t16_crosses_nodes_and_tp_time_jumps(one_t_text_search):
    by_t = {}
    for e in one_t_text_search.ranked:
        by_t.setdefault(e.config.t, e)
    assert by_t[8].links["tp"] == "nvlink" and by_t[16].links["tp"] == "network"
    # 6 all-reduces of b·s·h per layer per microbatch: 12 · 1.75 · 2048 · 25600 · 2 B · 512 · 128/p
    assert (by_t[8].time["tp"], by_t[16].time["tp"]) == pytest.approx((3.758, 96.637), abs=5e-4)
    assert by_t[16].step_time_s / by_t[8].step_time_s == pytest.approx(2.105, abs=5e-4)
    # t = 4 needs p = 64 to fit: bubble (p - 1)/m = 63/256 of compute vs 31/256 at t = 8, p = 32
    assert (by_t[4].config.p, by_t[8].config.p) == (64, 32)
    assert by_t[4].bubble_over_ideal_compute == 63 / 256 and by_t[8].bubble_over_ideal_compute == 31 / 256


def test_6_2_p_32_to_128_differ_little_and_p32_is_near_78_gb(one_t_text_search):
    best = {e.config.p: e for e in one_t_text_search.ranked if e.config.t == 8 and e.config.micro_batch == 1}
    assert [best[p].tflops_per_gpu for p in (32, 64, 128)] == pytest.approx([197.50, 197.40, 197.17], abs=0.005)
    assert best[32].memory_gb == pytest.approx(77.53, abs=0.005)  # "right at the limit" of 80 GB


def test_6_2_training_state_31_gb_at_tp_512_and_197_tflops():
    e = estimate(ONE_T, CLUSTER_1T, ParallelConfig(8, 64, 6), 3072, REFERENCE)
    assert e.memory["state"] / 1e9 == pytest.approx(16 * ONE_T.params / 512 / 1e9, rel=1e-3)  # 31.5 GB
    assert e.memory["state"] / 1e9 == pytest.approx(31.50, abs=0.005)
    assert e.tflops_per_gpu == pytest.approx(197.40, abs=0.005)  # at 75% of 312: above the measured 163
    assert e.tflops_per_gpu * 3072 / 1e3 == pytest.approx(606.4, abs=0.05)  # PFLOP/s, measured 502


def test_6_3_gpt3_feasible_bubbles_and_step_times():
    res = search(GPT3, CLUSTER_175, 1536, REFERENCE, t=8, micro_batch=1, v=1, recompute="full",
                 sequence_parallel=False, zero=0)
    assert sorted((e.config.p, e.config.d) for e in res.ranked) == [(8, 16), (16, 8), (32, 4)]
    for e in res.ranked:  # §6.3: bubble = (n/t - d)/B
        assert e.bubble_over_ideal_compute == pytest.approx((1024 / 8 - e.config.d) / 1536)
    steps = [e.step_time_s for e in res.ranked]
    assert max(steps) / min(steps) - 1 == pytest.approx(0.000813, abs=5e-6)  # "barely moves"
    assert res.rejected["memory"] == 3  # p = 1, 2, 4: p = 4 needs 16·P/32 = 87 GB of state alone
    assert 16 * GPT3.params / 32 / 1e9 == pytest.approx(87.3, abs=0.05)


def test_breakdown_adds_up_and_json_keys():
    e = estimate(GPT3, CLUSTER_175, ParallelConfig(8, 16, 8, 1, 2, "selective", True), 1536)
    assert sum(e.time.values()) == pytest.approx(e.step_time_s, rel=1e-12)
    assert set(e.as_dict()) >= {"t", "p", "d", "micro_batch", "v", "recompute", "sequence_parallel", "zero",
                                "device_layers", "step_time_s", "tflops_per_gpu", "mfu", "memory_gb",
                                "bubble_over_ideal_compute"}
    # executed FLOPs / model FLOPs: selective recomputation adds QKᵀ and attention·V, 4·s·h per token and layer
    s, h = GPT3.seq, GPT3.hidden
    executed = 96 * (3 * GPT3.layer_flops_per_token + 4 * s * h) + 3 * GPT3.logits_flops_per_token
    model = 3 * (96 * GPT3.layer_flops_per_token + GPT3.logits_flops_per_token)
    assert e.tflops_per_gpu / (e.mfu * 312) == pytest.approx(executed / model, rel=1e-12)


def test_search_ranks_and_every_result_is_feasible():
    res = search(GPT3, make_cluster("a100-80gb", 64), 128)
    steps = [e.step_time_s for e in res.ranked]
    # 1362 before the last stage held its logits (fp32, tokens × V/t); 1356 before the inventory's parameter count
    # (learned positions and norms whole over t): 6 layouts within 0.3 GB of 80 GB no longer fit, 2 of them at ZeRO-2 now
    assert steps == sorted(steps) and len(steps) == 1352
    for e in res.ranked:
        c = e.config
        assert e.fits and c.t * c.p * c.d == 64 and 128 % (c.d * c.micro_batch) == 0 and 96 % c.t == 0
        assert sum(e.rank_layers) == 96 and max(e.rank_layers) == math.ceil(96 / c.p)
    assert set(res.rejected) == {"memory", "interleave", "heads"}


def test_pins_are_respected():
    res = search(GPT3, CLUSTER_175, 1536, t=4, p=16, recompute="selective", sequence_parallel=True, zero=1)
    assert res.ranked and all((e.config.t, e.config.p, e.config.recompute, e.config.sequence_parallel, e.config.zero)
                              == (4, 16, "selective", True, 1) for e in res.ranked)


def test_bad_config_names_the_problem():
    with pytest.raises(ValueError, match="chunks need at least 254 layers"):
        estimate(GPT3, CLUSTER_175, ParallelConfig(8, 32, 4, v=8), 1536)
    with pytest.raises(ValueError, match="recompute"):
        ParallelConfig(8, 8, 16, recompute="some")
    with pytest.raises(ValueError, match="zero"):
        ParallelConfig(8, 8, 16, zero=4)
    with pytest.raises(ValueError, match="no interleaved schedule"):
        estimate(GPT3, CLUSTER_175, ParallelConfig(8, 8, 16, v=2), 1536, engine_assumptions(DEFAULT, "deepspeed"))


def test_links_named_by_span_even_when_bandwidths_are_equal():
    # the link names were a dict keyed by bandwidth: equal NVLink and network speeds made t = 8 "network"
    cluster = ClusterSpec(gpu_preset("a100-80gb").gpu, 64, gpus_per_node=8, intra_node_gbps=100.0, inter_node_gbps=100.0)
    e = estimate(GPT3, cluster, ParallelConfig(8, 8, 1), 8)
    assert e.links == {"tp": "nvlink", "pp": "network", "dp": "-"}
    e = estimate(GPT3, cluster, ParallelConfig(2, 8, 4), 8)
    assert e.links == {"tp": "nvlink", "pp": "network", "dp": "nvlink"}  # t·d = 8 ranks: one node


def test_tp_collectives_per_layer_as_megatron_runs_them():
    megatron, sync = DEFAULT, engine_assumptions(DEFAULT, "megatron-2021")
    assert tp_collectives(ParallelConfig(8, 1, 1, recompute="none"), sync) == 4  # f and g, forward and backward
    assert tp_collectives(ParallelConfig(8, 1, 1, recompute="full"), sync) == 6  # + the recomputed forward
    assert tp_collectives(ParallelConfig(8, 1, 1, recompute="full"), megatron) == 4  # backward's hidden
    # SP: the output gradient's all-gather cannot hide; the re-gather and input-gradient reduce-scatter can
    assert tp_collectives(ParallelConfig(8, 1, 1, recompute="selective", sequence_parallel=True), megatron) == 3
    assert tp_collectives(ParallelConfig(8, 1, 1, recompute="selective", sequence_parallel=True), sync) == 5


def test_fill_and_drain_transfers_counted_once():
    # p2p hidden in the steady state (REFERENCE): pipe = m·T + (p - 1)·T + 2(p - 1)·transfer exactly
    cfg = ParallelConfig(8, 8, 16, recompute="full")
    e = estimate(GPT3, CLUSTER_175, cfg, 1536, REFERENCE)
    m, p = 96, 8
    per_microbatch = (e.time["compute"] + e.time["tp"]) / m
    fill = e.time["pp"]
    assert e.step_time_s - e.time["dp"] == pytest.approx((m + p - 1) * per_microbatch + fill, rel=1e-12)
    act = 2048 * 12288 * 2
    assert fill == pytest.approx(2 * 7 * (act / 8 / 25e9 + 7 / 8 * act / 300e9), rel=1e-12)
