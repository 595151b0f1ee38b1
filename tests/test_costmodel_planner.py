"""§6.2 and §6.3 of the reference with its own model (REFERENCE), the search, and published runs (DEFAULT)."""

import math

import pytest

from modelpar.costmodel import (
    DEFAULT,
    REFERENCE,
    ParallelConfig,
    estimate,
    make_cluster,
    model_preset,
    search,
)
from modelpar.costmodel.published import PUBLISHED, compare

ONE_T = model_preset("megatron-1t")
GPT3 = model_preset("gpt3-175b")
CLUSTER_1T = make_cluster("a100-80gb", 3072)
CLUSTER_175 = make_cluster("a100-80gb", 1024)


@pytest.fixture(scope="module")
def one_t_text_search():
    # the text's search: its model, full recomputation, plain 1F1B, no sequence parallelism
    return search(ONE_T, CLUSTER_1T, 3072, REFERENCE, v=1, recompute="full", sequence_parallel=False)


def test_6_2_search_picks_t8(one_t_text_search):
    assert one_t_text_search.ranked[0].config.t == 8
    assert search(ONE_T, CLUSTER_1T, 3072, DEFAULT).ranked[0].config.t == 8  # also with everything searched


def test_6_2_t16_crosses_nodes_and_tp_time_jumps(one_t_text_search):
    by_t = {}
    for e in one_t_text_search.ranked:
        by_t.setdefault(e.config.t, e)
    assert by_t[8].links["tp"] == "nvlink" and by_t[16].links["tp"] == "network"
    assert by_t[16].time["tp"] > 5 * by_t[8].time["tp"]
    assert by_t[16].step_time_s > 1.5 * by_t[8].step_time_s
    assert by_t[4].time["bubble"] > by_t[8].time["bubble"]  # t < 8: more stages or fewer microbatches


def test_6_2_p_32_to_128_differ_little_and_p32_is_near_78_gb(one_t_text_search):
    best = {e.config.p: e for e in one_t_text_search.ranked if e.config.t == 8 and e.config.micro_batch == 1}
    steps = [best[p].step_time_s for p in (32, 64, 128)]
    assert max(steps) / min(steps) - 1 < 0.02
    assert best[32].memory_gb == pytest.approx(78, abs=0.6)
    assert best[32].memory_gb < 80 < best[32].memory_gb + 4  # "right at the limit"


def test_6_2_training_state_31_gb_at_tp_512_and_197_tflops():
    e = estimate(ONE_T, CLUSTER_1T, ParallelConfig(8, 64, 6), 3072, REFERENCE)
    assert e.memory["state"] / 1e9 == pytest.approx(31.5, abs=0.1)
    assert e.tflops_per_gpu == pytest.approx(197, rel=0.01)
    assert e.tflops_per_gpu * 3072 / 1e3 > 502  # the model is above the measured 502 PFLOP/s
    measured = estimate(ONE_T, CLUSTER_1T, ParallelConfig(8, 64, 6), 3072, DEFAULT)
    assert measured.tflops_per_gpu == pytest.approx(163, rel=0.05)  # SC'21 measured 163


def test_6_3_gpt3_feasible_bubbles_and_step_times():
    res = search(GPT3, CLUSTER_175, 1536, REFERENCE, t=8, micro_batch=1, v=1, recompute="full", sequence_parallel=False)
    configs = sorted((e.config.p, e.config.d) for e in res.ranked)
    assert configs == [(8, 16), (16, 8), (32, 4)]
    bubbles = sorted(e.bubble for e in res.ranked)
    assert bubbles[0] == pytest.approx(0.073, abs=5e-4) and bubbles[-1] == pytest.approx(0.081, abs=5e-4)
    for e in res.ranked:
        assert e.bubble == pytest.approx((1024 / 8 - e.config.d) / 1536)
    steps = [e.step_time_s for e in res.ranked]
    assert max(steps) / min(steps) - 1 < 0.003
    assert res.rejected["memory"] >= 1  # p = 4 needs 16·P/32 = 87 GB of state alone


def test_breakdown_adds_up_and_json_keys():
    e = estimate(GPT3, CLUSTER_175, ParallelConfig(8, 16, 8, 1, 2, "selective", True), 1536)
    assert sum(e.time.values()) == pytest.approx(e.step_time_s, rel=1e-12)
    assert set(e.as_dict()) >= {"t", "p", "d", "micro_batch", "v", "recompute", "sequence_parallel", "step_time_s",
                                "tflops_per_gpu", "mfu", "memory_gb", "bubble"}
    assert e.tflops_per_gpu > e.mfu * 312  # executed FLOPs include the recomputation


def test_search_ranks_and_every_result_is_feasible():
    res = search(GPT3, make_cluster("a100-80gb", 64), 128)
    steps = [e.step_time_s for e in res.ranked]
    assert steps == sorted(steps) and len(steps) > 5
    for e in res.ranked:
        c = e.config
        assert e.fits and c.t * c.p * c.d == 64 and 96 % (c.p * c.v) == 0 and 128 % (c.d * c.micro_batch) == 0
        assert 96 % c.t == 0
    assert set(res.rejected) >= {"memory", "interleave"}


def test_pins_are_respected():
    res = search(GPT3, CLUSTER_175, 1536, t=4, p=16, recompute="selective", sequence_parallel=True)
    assert res.ranked and all((e.config.t, e.config.p, e.config.recompute, e.config.sequence_parallel)
                              == (4, 16, "selective", True) for e in res.ranked)


def test_bad_config_names_the_problem():
    with pytest.raises(ValueError, match="layers"):
        estimate(GPT3, CLUSTER_175, ParallelConfig(8, 32, 4, v=4), 1536)
    with pytest.raises(ValueError, match="recompute"):
        ParallelConfig(8, 8, 16, recompute="some")


def test_published_runs_within_tolerance():
    rows = compare()
    assert len(rows) == len(PUBLISHED) >= 15
    errors = {run.name: err for run, _, err in rows}
    megatron = [abs(e) for n, e in errors.items() if n.startswith(("Megatron", "Korthikanti"))]
    assert max(megatron) < 0.10  # Megatron-LM runs, SC'21 and Korthikanti
    assert math.sqrt(sum(e * e for e in megatron) / len(megatron)) < 0.06
    assert abs(errors["Megatron 1T"]) < 0.03 and abs(errors["GPT-3 175B"]) < 0.12
    assert all(abs(e) < 0.35 for e in errors.values())  # other frameworks (DeepSpeed, Llama 3)
