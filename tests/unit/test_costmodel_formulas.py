"""The reference text's closed-form numbers: §1.1, §1.3, §2.3, §5.5, §5.6 and Korthikanti's formulas."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from modelpar.costmodel import (
    REFERENCE,
    ModelSpec,
    ParallelConfig,
    activation_bytes_per_layer,
    bandwidth_demand,
    bubble_fraction_of_step,
    bubble_over_ideal_compute,
    fused_cross_entropy_bytes,
    gpt_params,
    logits_allgather_bytes,
    megatron_flops,
    memory_breakdown,
    model_preset,
    pipeline_speedup,
    stages_needed,
    tp_comm_compute_ratio,
)

GPT3 = model_preset("gpt3-175b")


def test_gpt3_parameter_count_and_flops_match_megatron_equations():
    assert GPT3.params == pytest.approx(gpt_params(96, 12288, 51200, 2048), rel=1e-12)
    assert GPT3.params == pytest.approx(174.6e9, rel=1e-3)
    assert model_preset("megatron-1t").params == pytest.approx(1008.0e9, rel=1e-3)  # SC'21 Table 1
    # executed FLOPs with full recompute = 4 forward passes of the layers + 3 of the logits
    tokens = 1536 * 2048
    executed = tokens * (4 * 96 * GPT3.layer_flops_per_token + 3 * GPT3.logits_flops_per_token)
    assert executed == pytest.approx(megatron_flops(1536, 2048, 96, 12288, 51200, recompute=True), rel=1e-12)
    assert GPT3.model_flops(tokens) == pytest.approx(megatron_flops(1536, 2048, 96, 12288, 51200, False), rel=1e-12)


def test_section_1_1_eight_stages_for_inference_48_for_training():
    # assumption: stages fill whole 8-GPU nodes, every stage holds the same number of layers,
    # the first also the embedding (~0.35 layer); activations not counted (as the text says)
    assert GPT3.vocab * GPT3.hidden / GPT3.layer_params == pytest.approx(0.35, abs=0.005)  # word embedding
    assert stages_needed(GPT3, 80, bytes_per_param=2) == 8
    assert stages_needed(GPT3, 80, bytes_per_param=16) == 48
    assert GPT3.params * 16 / 1e12 == pytest.approx(2.8, abs=0.01)  # "175B needs 2.8 TB"


def test_section_1_3_bytes_per_second_per_gpu():
    need = bandwidth_demand(96, 12288, 2048, GPT3.params, 312e12, gpus=8)
    assert need["pipeline"] == pytest.approx(0.1175e9, rel=1e-3)
    assert need["tensor"] == pytest.approx(39.50e9, rel=1e-3)
    assert need["data"] == pytest.approx(88.87e9, rel=1e-3)
    nvlink, ib = 300e9, 25e9
    # "two orders of magnitude": 4 all-reduces per layer vs one activation per stage, 12·L/K·(t - 1)/t·... = 336
    assert need["tensor"] / need["pipeline"] == pytest.approx(336, rel=1e-12)
    # NVLink copes (13% of it), InfiniBand does not (158%); the pipeline needs 0.5% of InfiniBand
    assert (need["tensor"] / nvlink, need["tensor"] / ib, need["pipeline"] / ib) == pytest.approx(
        (0.1317, 1.5799, 0.0047), abs=5e-5)


def test_section_2_3_throughput_table():
    assert pipeline_speedup(8, 32) == pytest.approx(6.56, abs=0.005)
    assert all(pipeline_speedup(k, 1) == pytest.approx(1.0) for k in (2, 4, 8))
    slow = [pipeline_speedup(k, 1, comm=0.5) for k in (2, 4, 8)]
    assert slow[0] == pytest.approx(0.86, abs=0.005) and slow[-1] == pytest.approx(0.77, abs=0.005)
    # "only a little less": (M + K - 1)(1 + r) / ((M + K - 1)(1 + r) + 2(K - 1)·comm) = 117/124
    assert pipeline_speedup(8, 32, comm=0.5) / pipeline_speedup(8, 32) == pytest.approx(117 / 124, rel=1e-12)


@pytest.mark.parametrize("k,m,comm", [(2, 1, 0.0), (4, 4, 0.0), (8, 32, 0.0), (2, 1, 0.5), (4, 4, 0.5), (8, 32, 0.5)])
def test_section_2_3_closed_form_equals_simulated_gpipe(k, m, comm):
    from modelpar.schedules import gpipe
    from modelpar.simulate import Costs, simulate

    timeline = simulate(gpipe(ranks=k, microbatches=m), Costs(transfer=comm))
    single = 3 * k * m  # one GPU holding all K stages runs M·K·(forward + backward)
    assert single / timeline.step_time == pytest.approx(pipeline_speedup(k, m, comm), rel=1e-12)


def test_section_5_5_all_gather_logits_vs_fused_cross_entropy():
    tokens = 8 * 2048
    fused = fused_cross_entropy_bytes(tokens, 8)
    gpt2 = logits_allgather_bytes(tokens, 50257, 8)
    llama = logits_allgather_bytes(tokens, 128256, 8)
    assert (gpt2 / 1e9, llama / 1e9, fused / 1e6) == pytest.approx((1.44, 3.68, 0.34), abs=0.005)
    assert round(gpt2 / fused) == 4188 and round(llama / fused) == 10688
    # exercise 9: V = 64000, 4 x 4096 tokens: 1.83 GB vs 0.34 MB, ~5300x
    ex9 = logits_allgather_bytes(4 * 4096, 64000, 8)
    assert ex9 / 1e9 == pytest.approx(1.835, abs=1e-3) and round(ex9 / fused, -2) == 5300


def test_section_5_6_ratio_independent_of_batch_and_rises_with_t():
    nvlink = [tp_comm_compute_ratio(12288, t, 312e12, 300e9) for t in (2, 4, 8, 16)]
    assert nvlink == sorted(nvlink)
    assert nvlink[2] == pytest.approx(2 * 7 / (9 * 12288) * 312e12 / 300e9, rel=1e-12)  # 2(t-1)/(9h) bytes/FLOP
    assert nvlink[2] == pytest.approx(0.132, abs=5e-4)
    # across nodes communication takes 1.58x the compute: 12 (= 300/25) times the NVLink ratio
    assert tp_comm_compute_ratio(12288, 8, 312e12, 25e9) == pytest.approx(12 * nvlink[2], rel=1e-12)
    assert tp_comm_compute_ratio(12288, 8, 312e12, 25e9) == pytest.approx(1.580, abs=5e-4)


def test_korthikanti_table_2():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    assert activation_bytes_per_layer(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert activation_bytes_per_layer(s, b, h, a, t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert activation_bytes_per_layer(s, b, h, a, t, True) == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert activation_bytes_per_layer(s, b, h, a, t, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    assert activation_bytes_per_layer(s, b, h, a, t, True, "selective") == pytest.approx(34 * sbh / t)
    assert activation_bytes_per_layer(s, b, h, a, t, recompute="full") == 2 * sbh
    assert GPT3.act_sharded_coeff == 24


def test_first_stage_holds_p_microbatches_and_interleaving_factor():
    base = ParallelConfig(8, 8, 16, recompute="selective", sequence_parallel=True)
    per_layer = activation_bytes_per_layer(2048, 1, 12288, 96, 8, True, "selective")
    acts = memory_breakdown(GPT3, base, 96, REFERENCE)["activations"]
    assert acts == pytest.approx(per_layer * 96)  # L/p layers x p microbatches = all L layers
    inter = ParallelConfig(8, 8, 16, v=4, recompute="selective", sequence_parallel=True)
    assert memory_breakdown(GPT3, inter, 96, REFERENCE)["activations"] == pytest.approx(acts * (1 + 7 / 32))
    few = memory_breakdown(GPT3, base, 4, REFERENCE)["activations"]  # m < p: only m in flight
    assert few == pytest.approx(per_layer * 12 * 4)


@given(p=st.integers(1, 64), d=st.integers(1, 64), t=st.sampled_from([1, 2, 4, 8]))
def test_section_6_3_bubble_is_n_over_t_minus_d_over_batch(p, d, t):
    n, batch = t * p * d, 64 * d
    assert bubble_over_ideal_compute(p, batch // d) == pytest.approx((n / t - d) / batch)


@given(k=st.integers(1, 64), m=st.integers(1, 512))
def test_gpipe_bubble_and_speedup_agree(k, m):
    assert pipeline_speedup(k, m) == pytest.approx(k * (1 - bubble_fraction_of_step(k, m)))


def test_generalised_counts_for_gated_gqa_models():
    llama = model_preset("llama3-70b")
    assert llama.params == pytest.approx(70.55e9, rel=1e-3)  # model card: 70.6B
    assert model_preset("llama3-405b").params == pytest.approx(405.85e9, rel=1e-3)
    assert model_preset("llama3-8b").params == pytest.approx(8.03e9, rel=1e-3)
    assert llama.act_sharded_coeff == pytest.approx(4 + 4 / 8 + 6 * 28672 / 8192)
    with pytest.raises(ValueError, match="kv_heads"):
        ModelSpec(2, 64, 8, 16, 100, kv_heads=3)
    assert math.isclose(ModelSpec(2, 64, 8, 16, 100).ffn_size, 256)
