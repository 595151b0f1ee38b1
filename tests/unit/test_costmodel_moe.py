"""The cost model's mixture-of-experts figures: Mixtral 8x7B's published parameter counts, and the all-to-all volume."""

import pytest

from modelpar.costmodel.moe import (
    MOE_OPS,
    MOE_OPS_PER_EXPERT,
    MoESpec,
    active_moe_layer_params,
    all_to_all_bytes,
    all_to_alls,
    moe_activation_bytes,
    moe_gemms,
    moe_layer_params,
    moe_layer_seconds,
)
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


def test_moe_gemms_all_to_alls_and_seconds_by_hand():
    # 64 tokens, h 32, E 4 of width 16, top-2, one shared, t 1, ep 2: each rank's 2 experts get 2·128/4 = 64 rows
    spec = MoESpec(experts=4, ffn=16, shared=1, top_k=2)
    assert moe_gemms(spec, 64, 32, ep=2) == [(1, (64, 4, 32)), (2, (64, 32, 32)), (2, (64, 32, 16)),
                                             (1, (64, 32, 32)), (1, (64, 32, 16))]
    assert moe_gemms(MoESpec(4, 16, capacity_factor=0.5), 64, 32)[1] == (4, (16, 32, 32))  # half the rows kept
    assert all_to_alls(spec, 64, 32, 2, 4) == [("forward", 64 * 2 / 2 * 32 * 4)] * 2 + [("backward", 8192.0)] * 2
    assert all_to_alls(spec, 64, 32, 1, 4) == []
    flops = lambda m, n, k: 2.0 * m * n * k  # noqa: E731  seconds = FLOPs: the sums are FLOP counts
    mlp = [(64, 64, 32), (64, 32, 32)]  # a dense SwiGLU of width 32: 2·64·(64·32 + 32·32) FLOPs forward
    sec = moe_layer_seconds(spec, 64, 32, 1, 2, 4, mlp, flops, lambda sent: sent, 0.5)
    moe_fwd = 2 * 64 * (4 * 32 + 2 * 48 * 32 + 48 * 32)  # router, 2 local experts' 3·32·16, the shared 3·32·16
    assert sec.forward == moe_fwd - 2 * 64 * 96 * 32 + (MOE_OPS + MOE_OPS_PER_EXPERT * 2) * 0.5
    assert sec.wgrad == moe_fwd - 2 * 64 * 96 * 32 and sec.a2a_forward == sec.a2a_backward == 2 * 8192


@pytest.mark.parametrize("router,shared,cf", [("softmax", 0, None), ("softmax", 1, None), ("sigmoid", 0, None),
                                              ("softmax", 0, 4.0)])
def test_moe_activation_bytes_are_what_autograd_keeps(router, shared, cf):
    """The MoE block's saved tensors (saved-tensor hooks, parameters excluded, each storage once) equal the
    formula plus the block's input, exactly: dropless (or CF 4, nothing dropped) the expert rows are b·s·k
    however the router splits them, and no term depends on the split."""
    import torch

    from modelpar.model.moe import MoE

    b, s, h, e, k, f = 2, 16, 32, 4, 2, 24
    torch.manual_seed(0)
    block = MoE(h, e, k, f, shared, router, cf, 0.01, dtype=torch.float64).train()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(b, s, h, dtype=torch.float64, requires_grad=True)
    owned = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in owned:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    spec = MoESpec(e, f, shared, top_k=k, capacity_factor=cf, router=router)
    assert sum(seen.values()) == moe_activation_bytes(spec, b * s, b, h, 1, 8) + b * s * h * 8


def test_expert_gradients_reduced_apart_over_d_over_ep():
    """Under ep > 1 the routed experts' gradients are all-reduced over the d/ep replicas holding them, after the
    step (``training.grads``), a bucket per expert tensor (2 here); the rest over d. CPU_DEFAULT's all-reduce fit:
    100 µs + bytes at 1 GB/s."""
    from modelpar.costmodel.local import predict_local
    from modelpar.costmodel.local_memory import LocalLayout, state_bytes
    from modelpar.costmodel.presets import CPU_DEFAULT
    from modelpar.costmodel.specs import ModelSpec
    from modelpar.formulas import allreduce_bytes

    spec = ModelSpec(layers=2, hidden=8, heads=2, seq=4, vocab=64, ffn=16, gated_mlp=True, tied_embeddings=False,
                     learned_positions=False, bias=False, dropout=False)
    run = LocalLayout(spec, d=4, batch=8, microbatches=1, overlap=False, moe=MoESpec(4, 8, every=2), ep=2)
    experts = (256 + 128) * 4  # layer 1's 2 local experts, fp32
    dense = state_bytes(run, [0])["gradients"] - experts
    want = 1e-4 + allreduce_bytes(dense, 4) / 1e9 + 2e-4 + allreduce_bytes(experts, 2) / 1e9  # one per expert tensor
    assert predict_local(run, CPU_DEFAULT).time["dp"] == pytest.approx(want)
