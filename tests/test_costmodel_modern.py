"""Modern architectures in the cost model: GQA, SwiGLU, untied embeddings, flash attention, uneven stages,
the distributed optimizer, and the published Llama 3 / DeepSpeed runs."""

import pytest

from modelpar.costmodel import (
    DEFAULT,
    MODERN,
    ModelSpec,
    ParallelConfig,
    activation_bytes_per_layer,
    make_cluster,
    megatron_flops,
    memory_breakdown,
    model_preset,
    search,
)
from modelpar.costmodel.memory import in_flight, stage_loads, state_bytes_per_param
from modelpar.costmodel.published import PUBLISHED, PublishedRun, predict

# h = 64, 8 heads of 8, 2 KV heads (r = 1/4), SwiGLU with ffn = 160, untied, RoPE, RMSNorm, no bias/dropout
TINY = ModelSpec(2, 64, 8, 16, 100, ffn=160, kv_heads=2, gated_mlp=True, tied_embeddings=False,
                 learned_positions=False, bias=False, dropout=False)


def test_tiny_gqa_swiglu_counts_by_hand():
    # Q 64·64, K and V 64·16 each, O 64·64, MLP 3·64·160, two RMSNorm weights 2·64
    assert TINY.layer_matmul_params == 4096 + 2 * 1024 + 4096 + 30720
    assert TINY.layer_params == 40960 + 128
    assert TINY.params == 2 * 41088 + 2 * 100 * 64  # untied: input embedding + output layer
    assert TINY.layer_flops_per_token == 2 * 40960 + 4 * 16 * 64  # 2 per weight + QKᵀ and AV
    # 6·N·tokens (N without norms and the input embedding, which do no matmul) + the attention term
    tokens = 3 * 16
    six_n = 6 * (2 * 40960 + 64 * 100) * tokens
    assert TINY.model_flops(tokens) == six_n + 12 * 2 * 16 * 64 * tokens
    # activations: replicated 8 (two norm inputs, QKV and MLP inputs; no dropout masks),
    # sharded Q 2 + K, V 2r each + O 2 + MLP 6·ffn/h
    assert TINY.act_replicated_coeff == 8 and TINY.act_sharded_coeff == 4 + 4 / 4 + 6 * 160 / 64


def test_gpt_reduces_to_megatron_and_korthikanti():
    gpt = model_preset("gpt3-175b")
    assert (gpt.act_replicated_coeff, gpt.act_sharded_coeff) == (10, 24)
    assert gpt.model_flops(1536 * 2048) == pytest.approx(megatron_flops(1536, 2048, 96, 12288, 51200, False), rel=1e-12)


@pytest.mark.parametrize("name,billions", [("llama3-8b", 8.03), ("llama3-70b", 70.55), ("llama3-405b", 405.85)])
def test_llama3_presets_real_shapes_and_parameter_counts(name, billions):
    m = model_preset(name)
    assert m.params / 1e9 == pytest.approx(billions, rel=2e-3)
    assert (m.kv_heads, m.vocab, m.seq, m.gated_mlp, m.tied_embeddings) == (8, 128256, 8192, True, False)
    shapes = {"llama3-8b": (32, 4096, 32, 14336), "llama3-70b": (80, 8192, 64, 28672),
              "llama3-405b": (126, 16384, 128, 53248)}
    assert (m.layers, m.hidden, m.heads, m.ffn) == shapes[name]


def test_llama_405b_activations_flash_sp():
    m, s, h = model_preset("llama3-405b"), 8192, 16384
    got = activation_bytes_per_layer(s, 1, h, m.heads, 8, True, "none", m.act_sharded_coeff, True,
                                     m.act_replicated_coeff)
    assert got == pytest.approx(s * h / 8 * (8 + 4 + 4 / 16 + 6 * 53248 / 16384))  # 31.75 s·b·h/t, no s² term
    assert got / 1e6 == pytest.approx(532.7, abs=0.1)


def test_uneven_stages_lighten_first_and_last():
    assert stage_loads(96, 8) == (12, 12, 12)
    assert stage_loads(126, 16, 8) == (7, 8, 7)  # Llama 3: 128 slots, embedding and output take one each
    assert stage_loads(70, 12) == (5, 6, 5)  # BLOOM: 70 + 2 embeddings = 12·6
    assert stage_loads(126, 2) == (63, 63, 63) and stage_loads(7, 2) == (3, 4, 4)
    assert in_flight(8, 4, 96, 0) == pytest.approx(8 * (1 + 7 / 32))  # Korthikanti's interleaved factor
    assert in_flight(8, 1, 96, 1) == 7 and in_flight(8, 1, 4, 0) == 4
    assert in_flight(8, 2, 8, 0) == 8  # m = p: everything is warm-up, m·v chunk passes, not 11.5


def test_distributed_optimizer_and_fsdp_state_bytes():
    cfg = ParallelConfig(8, 16, 64)
    assert state_bytes_per_param(cfg, DEFAULT) == 16
    assert state_bytes_per_param(cfg, MODERN) == pytest.approx(6 + 12 / 64)  # BF16 + FP32 grads, ZeRO-1
    assert state_bytes_per_param(cfg, MODERN.with_(sharded_state_bytes=16)) == pytest.approx(2 + 16 / 64)
    assert MODERN.memory_limit(80) == 80 * 2**30 and DEFAULT.memory_limit(80) == 80e9


def test_llama_405b_memory_most_loaded_is_second_device():
    m, a = model_preset("llama3-405b"), MODERN.with_(uneven_layers=True, sharded_state_bytes=16)
    cfg = ParallelConfig(8, 16, 64, 1, 8, "none", True)
    mem = memory_breakdown(m, cfg, 32, a)
    per_layer = activation_bytes_per_layer(8192, 1, 16384, 128, 8, True, "none", m.act_sharded_coeff, True, 8)
    assert mem["activations"] == pytest.approx(per_layer * 8 * (2 * 14 + 7 * 16 + 1) / 8)  # rank 1: 141 layer passes
    assert sum(mem.values()) / 2**30 < 80 < sum(memory_breakdown(m, cfg, 32, a.with_(sharded_state_bytes=12)).values()) / 2**30


def _run(prefix: str) -> list[PublishedRun]:
    return [r for r in PUBLISHED if r.name.startswith(prefix)]


def test_llama3_405b_picks_its_published_layout_within_12_percent():
    for run in _run("Llama 3 405B"):
        assert predict(run) == pytest.approx(run.measured, rel=0.12)  # 47.1/44.3% vs 43/41% MFU
        best = search(run.model, make_cluster(run.gpu, run.gpus), run.batch, MODERN.with_(**run.framework),
                      **run.pins).ranked[0]
        c = best.config  # §3.3.2: v = 8 chunks of one layer, no activation checkpointing at 8K
        assert (c.t, c.p, c.micro_batch, c.v, c.recompute) == (8, 16, 1, 8, "none")


def test_deepspeed_runs_within_8_percent():
    runs = _run("MT-NLG") + _run("BLOOM")
    assert len(runs) == 4
    for run in runs:
        assert predict(run) == pytest.approx(run.measured, rel=0.08)  # MT-NLG fitted, BLOOM held out
