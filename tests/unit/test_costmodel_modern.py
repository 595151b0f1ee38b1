"""Modern architectures in the cost model: GQA, SwiGLU, untied embeddings, flash attention, uneven stages,
the distributed optimizer, and the published Llama 3 / DeepSpeed runs."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from modelpar.costmodel import (
    DEFAULT,
    MODERN,
    ModelSpec,
    ParallelConfig,
    activation_bytes_per_layer,
    device_params,
    megatron_flops,
    memory_breakdown,
    model_preset,
    rank_layers,
    split_layers,
    training_state_bytes,
)
from modelpar.costmodel.memory import in_flight
from modelpar.costmodel.request import parse_plan_command

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
    assert split_layers(96, 8) == (12,) * 8
    assert split_layers(70, 12) == (5,) + (6,) * 10 + (5,)  # BLOOM: 70 + 2 embeddings = 12·6
    llama = split_layers(126, 16, 8)  # 128 one-layer chunks: the first and last hold only embedding, output
    assert llama[0] == llama[-1] == 0 and set(llama[1:-1]) == {1}
    assert rank_layers(llama, 16) == (7,) + (8,) * 14 + (7,)
    assert split_layers(100, 8) == (12, 13, 12, 13, 13, 12, 13, 12)  # 4 extra layers spread over the middle
    assert split_layers(7, 2) == (3, 4) and split_layers(5, 1) == (5,)
    with pytest.raises(ValueError, match="p·v = 20 chunks need at least 18 layers"):
        split_layers(17, 10, 2)
    assert in_flight(8, 4, 96, 0) == pytest.approx(8 * (1 + 7 / 32))  # Korthikanti's interleaved factor
    assert in_flight(8, 1, 96, 1) == 7 and in_flight(8, 1, 4, 0) == 4
    assert in_flight(8, 2, 8, 0) == 8  # m = p: everything is warm-up, m·v chunk passes, not 11.5


@given(layers=st.integers(1, 200), p=st.integers(1, 64), v=st.integers(1, 8))
def test_default_split_is_as_even_as_possible(layers, p, v):
    if p * v > layers + 2:
        return
    split = split_layers(layers, p, v)
    assert sum(split) == layers and len(split) == p * v
    assert max(split) - min(split) <= 1 and all(n >= 1 for n in split[1:-1])
    assert split[0] == min(split)  # the first chunk (embedding) never holds an extra layer


def test_zero_state_bytes_per_parameter():
    # MODERN: BF16 weights 2 + FP32 gradients 4 + AdamW 12; the stages shard 12, then 4 more, then 2 more over d
    P, d = 64_000, 64
    per_param = [training_state_bytes(P, d, z, MODERN.param_bytes, MODERN.grad_bytes) / P for z in range(4)]
    assert per_param == pytest.approx([18, 6 + 12 / d, 2 + 16 / d, 18 / d], rel=1e-12)
    assert training_state_bytes(P, d, 0, DEFAULT.param_bytes, DEFAULT.grad_bytes) == 16 * P  # the text's 16 B
    assert MODERN.memory_limit(80) == 80 * 2**30 and DEFAULT.memory_limit(80) == 80e9


def test_llama_405b_memory_most_loaded_is_second_device():
    m = model_preset("llama3-405b")
    cfg = ParallelConfig(8, 16, 64, 1, 8, "none", True, zero=2)  # Llama 3's FSDP: ZeRO-2
    mem = memory_breakdown(m, cfg, 32, MODERN)
    per_layer = activation_bytes_per_layer(8192, 1, 16384, 128, 8, True, "none", m.act_sharded_coeff, True, 8)
    assert mem["activations"] == pytest.approx(per_layer * 8 * (2 * 14 + 7 * 16 + 1) / 8)  # rank 1: 141 layer passes
    params = device_params(m, cfg, 1)
    assert mem["state"] == training_state_bytes(params, 64, 2, 2, 4)
    gib = [sum(memory_breakdown(m, ParallelConfig(8, 16, 64, 1, 8, "none", True, zero=z), 32, MODERN).values()) / 2**30
           for z in (1, 2)]
    assert gib == pytest.approx([89.25, 77.56], abs=0.005)  # fits 80 GiB only with the gradients sharded too


def test_llama3_405b_command_line_picks_its_published_layout():
    for g in (8192, 16384):
        req = parse_plan_command(f"--model llama3-405b --gpu h100-sxm --gpus {g} --batch 2048 --tp 8 --pp 16 --zero 2")
        c = req.search().ranked[0].config  # §3.3.2: v = 8 chunks of one layer, no activation checkpointing at 8K
        assert (c.t, c.p, c.micro_batch, c.v, c.recompute, c.sequence_parallel) == (8, 16, 1, 8, "none", True)
