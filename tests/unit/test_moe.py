"""Mixture of experts on one process: routing, capacity, the aux loss and the layer, hand-checked."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from modelpar.model import ModelConfig, build_stage
from modelpar.model.moe import MoE, capacity, moe_modules, route


@pytest.fixture(autouse=True)
def _float64():
    """Every test here computes in float64 (hand-checked to 1e-15); the rest of the suite in float32."""
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def test_route_top1_capacity_and_aux_by_hand() -> None:
    # 4 tokens, 2 experts, k = 1, capacity ceil(1·4·1/2) = 2: the third token for expert 0 is dropped
    logits = torch.tensor([[[2.0, 0.0], [2.0, 0.0], [2.0, 0.0], [0.0, 2.0]]])
    r = route(logits, 1, "softmax", 1.0)
    assert r.experts.flatten().tolist() == [0, 0, 0, 1]
    assert r.kept.flatten().tolist() == [True, True, False, True]
    assert torch.equal(r.gates, torch.ones(1, 4, 1))  # one choice: its gate renormalises to 1
    a = 1 / (1 + math.exp(-2))  # softmax([2, 0])[0]
    p0, p1 = (3 * a + (1 - a)) / 4, (3 * (1 - a) + a) / 4
    assert r.aux.item() == pytest.approx(2 * (0.75 * p0 + 0.25 * p1), abs=1e-15)
    assert route(logits, 1, "softmax", None).kept.all()  # dropless
    assert capacity(4, 1, 2, 1.0) == 2 and capacity(4, 2, 8, 0.1) == 1 and capacity(10, 2, 4, 1.25) == 7


def test_route_gates_renormalised_and_sigmoid() -> None:
    r = route(torch.tensor([[[1.0, 2.0, 3.0]]]), 2)
    assert r.experts.flatten().tolist() == [2, 1]
    assert r.gates.flatten().tolist() == pytest.approx([1 / (1 + math.exp(-1)), 1 / (1 + math.exp(1))], abs=1e-15)
    s = route(torch.tensor([[[0.0, math.log(3.0)]]]), 1, "sigmoid")  # sigmoid scores 0.5, 0.75
    assert s.experts.item() == 1 and s.gates.item() == 1.0
    assert s.aux.item() == pytest.approx(2 * (0.0 * 0.4 + 1.0 * 0.6), abs=1e-15)  # P = scores / their sum


@pytest.mark.parametrize("k", [1, 2, 3])
def test_aux_is_one_when_scores_are_uniform(k: int) -> None:
    assert route(torch.zeros(3, 5, 4), k).aux.tolist() == pytest.approx([1.0] * 3, abs=1e-15)


def _naive(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Σ_kept gate · SwiGLU_e(x_t) token by token (+ the shared experts)."""
    r = route(moe.router(x), moe.top_k, moe.router_kind, moe.capacity_factor)
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            for j in range(moe.top_k):
                if r.kept[b, t, j]:
                    e = r.experts[b, t, j]
                    gate, up = (moe.experts.gate_up[e] @ x[b, t]).chunk(2)
                    out[b, t] += r.gates[b, t, j] * (moe.experts.down[e] @ (F.silu(gate) * up))
    return out if moe.shared is None else out + moe.shared(x)


@pytest.mark.parametrize(("router", "cf", "shared"), [("softmax", None, 0), ("softmax", 0.5, 1), ("sigmoid", 1.0, 2)])
def test_layer_equals_token_by_token_and_aux_gradient(router: str, cf: float | None, shared: int) -> None:
    torch.manual_seed(0)
    moe = MoE(8, 4, 2, 6, shared=shared, router=router, capacity_factor=cf, aux_loss_coef=0.3)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(3, 5, 8)
    y = moe(x)
    torch.testing.assert_close(y, _naive(moe, x), rtol=0, atol=1e-13)
    y.square().sum().backward()
    got = [p.grad.clone() for p in moe.parameters()]  # type: ignore[union-attr]
    stats = moe.take_stats()
    moe.zero_grad()
    r = route(moe.router(x), 2, router, cf)
    (_naive(moe, x).square().sum() + 0.3 * r.aux.mean()).backward()  # the loss the layer's backward adds
    for g, p in zip(got, moe.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=1e-12)
    assert stats[:4].sum().item() == 3 * 5 * 2  # every assignment counted, before dropping
    assert stats[4].item() == (~r.kept).sum().item() and stats[6].item() == 3
    assert stats[5].item() == pytest.approx(r.aux.sum().item(), abs=1e-12)
    assert (stats[4].item() == 0) == (cf is None)  # these seeds overflow both capacities


def test_model_counts_and_every_nth_layer() -> None:
    cfg = ModelConfig(arch="llama", experts=4, top_k=2, shared_experts=1, moe_every=2, expert_ffn=32, layers=4,
                      hidden=32, heads=4, seq_len=8).check()
    assert cfg.moe_layers == (1, 3)
    model = build_stage(cfg)
    assert [n for n, _ in moe_modules(model)] == ["layers.1.mlp", "layers.3.mlp"]
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()
    dense = ModelConfig(arch="llama", layers=4, hidden=32, heads=4, seq_len=8)
    per_token = 2 * (32 * 4 + 3 * 32 * 32 * (2 + 1) - 3 * 32 * dense.ffn_hidden)  # router + k + S experts - MLP
    assert cfg.flops_per_token() == pytest.approx(dense.flops_per_token() + 3 * 2 * per_token)


@pytest.mark.parametrize(("change", "words"), [
    ({"top_k": 5}, "top_k must be an integer from 1 to experts (4), got 5"),
    ({"arch": "gpt"}, "experts (4) needs arch 'llama'"),
    ({"capacity_factor": 0.0}, "capacity_factor must be > 0.0, got 0.0"),
    ({"router": "relu"}, "router"),
])
def test_bad_moe_config(change: dict[str, object], words: str) -> None:
    values = {"arch": "llama", "experts": 4, "top_k": 2, **change}
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig(**values).check()  # type: ignore[arg-type]


def test_the_expert_layout_rule() -> None:
    """ep folds into d with every ZeRO stage and t (expert tensor parallelism 1: the routed experts whole
    on every tp rank, so their bytes do not depend on t); cp and sequence parallelism are refused."""
    from modelpar.costmodel.moe import check_trainer_experts, moe_layer_tensors
    from modelpar.training import TrainConfig

    moe = ModelConfig(arch="llama", hidden=32, heads=4, layers=2, seq_len=8, experts=4, top_k=2)
    for zero in (0, 1, 2, 3):
        TrainConfig(model=moe, tp=2, pp=1, dp=4, ep=2, zero=zero, batch_size=8, microbatches=1).check(8)
    check_trainer_experts(experts=4, ep=4, dp=8)
    routed = {t: [n for kind, n in moe_layer_tensors(32, 4, 64, shared=1, t=t, ep=2) if kind == "expert"]
              for t in (1, 2, 4)}
    assert routed[1] == routed[2] == routed[4] == [2 * 2 * 64 * 32, 2 * 32 * 64]  # E/ep = 2 experts, whole
    for kwargs, words in [(dict(experts=4, ep=2, dp=4, cp=2), "experts with cp > 1 is not supported"),
                          (dict(experts=4, ep=2, dp=4, sequence_parallel=True), "experts with sequence_parallel"),
                          (dict(experts=6, ep=4, dp=4), "experts (6) must be divisible by ep (4)"),
                          (dict(experts=0, ep=2, dp=2), "ep (2) needs a mixture of experts")]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            check_trainer_experts(**kwargs)  # type: ignore[arg-type]
