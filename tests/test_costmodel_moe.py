"""The cost model's mixture-of-experts figures: Mixtral 8x7B's published parameter counts, and the all-to-all volume."""

import pytest

from modelpar.costmodel.moe import active_moe_layer_params, all_to_all_bytes, moe_layer_params
from modelpar.model import ModelConfig


def test_mixtral_8x7b_total_and_active_parameters():
    # Mixtral of Experts (Jiang et al. 2024, arXiv:2401.04088, Table 1): h 4096, 32 layers, 32 heads, 8 kv heads,
    # FFN 14336, 8 experts, top-2, vocabulary 32000; "47B parameters, 13B active" (the model card: 46.7B / 12.9B)
    h, layers, experts, ffn, vocab = 4096, 32, 8, 14336, 32000
    attention = 2 * h * h + 2 * h * 1024  # q and o, k and v of 8 kv heads of 128
    norms = 2 * h
    total = layers * (attention + norms + moe_layer_params(h, experts, ffn)) + 2 * vocab * h + h
    active = layers * (attention + norms + active_moe_layer_params(h, experts, 2, ffn)) + 2 * vocab * h + h
    assert total / 1e9 == pytest.approx(46.70, abs=0.01)
    assert active / 1e9 == pytest.approx(12.88, abs=0.01)
    cfg = ModelConfig(arch="llama", vocab_size=vocab, hidden=h, heads=32, kv_heads=8, layers=layers, ffn=ffn,
                      experts=experts, top_k=2, seq_len=4096)
    assert cfg.num_parameters() == total + (cfg.padded_vocab_size - vocab) * 2 * h  # the runtime's count agrees


def test_all_to_all_volume():
    # 4096 tokens, top-2, h 4096, bf16, ep 8: 7/8 of 8192 rows of 8 KiB leave the rank
    assert all_to_all_bytes(4096, 4096, 2, 8, 2) == 4096 * 2 * 7 / 8 * 4096 * 2
    assert all_to_all_bytes(10, 32, 2, 1, 8) == 0.0  # ep = 1: nothing leaves
    assert all_to_all_bytes(10, 32, 2, 2, 8, remote_share=0.25) == 10 * 2 * 0.25 * 32 * 8
