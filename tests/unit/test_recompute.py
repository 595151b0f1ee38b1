"""Recomputation: bitwise gradients, measured held activations and re-runs vs the closed forms (§4.3)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from modelpar.recompute import (
    ActivationMeter,
    Recompute,
    RecomputePlan,
    best_k,
    chain_cost,
    measure_chain,
    plan_recompute,
    recompute_sequential,
    recompute_stage,
)

N = 64  # the reference's tanh chain
ROWS, WIDTH = 16, 32
TANH_CHAIN = [torch.tanh] * N
STRATEGIES = [None, 1, 2, 4, 8, 16, 64, "sqrt", "full", "recompute-all"]


def _equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _tanh_input(seed: int = 0) -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).requires_grad_()


@pytest.fixture(scope="module")
def tanh_reference() -> list[torch.Tensor]:
    x = _tanh_input()
    h = x
    for _ in range(N):
        h = torch.tanh(h)
    return list(torch.autograd.grad(h.sum(), [x]))


@pytest.mark.parametrize("recompute", STRATEGIES)
def test_tanh_chain_gradients_bitwise_equal_plain_autograd(recompute, tanh_reference):
    _, grads = measure_chain(TANH_CHAIN, _tanh_input(), recompute)
    assert _equal(grads, tanh_reference)


def test_tanh_chain_held_is_n_over_k_plus_k_minimum_at_sqrt_n():
    held = {}
    for k in range(1, N + 1):
        report, _ = measure_chain(TANH_CHAIN, _tanh_input(), k)
        assert (report.held, report.extra_forwards) == (chain_cost(N, k).held, chain_cost(N, k).extra_forwards)
        assert report.forwards == N and report.extra_forwards == N  # every layer re-run once: one more forward
        assert report.intermediates == chain_cost(N, k).intermediates == N - math.ceil(N / k)
        assert report.held_bytes == report.held * ROWS * WIDTH * 8
        held[k] = report.held
    for k in (1, 2, 4, 8, 16, 32, 64):
        assert held[k] == N // k + k
        assert measure_chain(TANH_CHAIN, _tanh_input(), k)[0].intermediates == N - N // k  # k - 1 per segment
    fewest = min(held.values())
    assert fewest == held[8] == 2 * math.isqrt(N) == 16  # 2√n at k = √n
    assert [k for k in held if held[k] == fewest] == [6, 7, 8, 9, 10, 11]  # a shorter last segment can tie


def test_store_all_and_recompute_all_extremes():
    store, _ = measure_chain(TANH_CHAIN, _tanh_input(), None)
    assert (store.label, store.held, store.extra_forwards) == ("none", N, 0)
    every_all, _ = measure_chain(TANH_CHAIN, _tanh_input(), "recompute-all")
    assert (every_all.held, every_all.extra_forwards) == (2, N * (N + 1) // 2) == (2, 2080)
    assert every_all.intermediates == chain_cost(N, "recompute-all").intermediates == 2079


def test_exercise_6_hundred_layers():
    costs = {k: chain_cost(100, k).held for k in range(1, 101)}
    assert min(costs.values()) == costs[10] == 20 and best_k(100) == 10 and best_k(64) == 8
    assert chain_cost(100, 10).extra_forwards == 100  # each layer re-run once (autograd needs its graph) ...
    assert chain_cost(100, 10).intermediates == 90  # ... re-creating the reference's 100 - 100/k activations


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 24), data=st.data())
def test_any_chain_matches_the_closed_form(n, data):
    recompute = data.draw(st.one_of(st.none(), st.integers(1, n), st.sampled_from(["sqrt", "full", "recompute-all"])))
    width = data.draw(st.integers(1, 5))
    x = torch.randn(3, width, dtype=torch.float64).requires_grad_()
    report, grads = measure_chain([torch.tanh] * n, x, recompute)
    _, plain = measure_chain([torch.tanh] * n, x, None)
    expected = chain_cost(n, recompute)
    assert (report.held, report.extra_forwards, report.forwards) == (expected.held, expected.extra_forwards, n)
    assert report.intermediates == expected.intermediates
    assert _equal(grads, plain)


# -- transformer-style blocks with dropout, and the torch anchor -------------------------------


@pytest.fixture(scope="module")
def blocks() -> nn.Sequential:
    torch.manual_seed(0)
    layer = dict(d_model=16, nhead=2, dim_feedforward=32, dropout=0.2, batch_first=True, norm_first=True, dtype=torch.float64)
    return nn.Sequential(*[nn.TransformerEncoderLayer(**layer) for _ in range(6)])


def _block_run(blocks: nn.Sequential, fn) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Output, gradients (input, then parameters) and the next random number after the step."""
    x = torch.randn(3, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    for p in blocks.parameters():
        p.grad = None
    torch.manual_seed(7)
    out = fn(x)
    (out * out).sum().backward()
    return out.detach(), [x.grad, *(p.grad for p in blocks.parameters())], torch.rand(3)


@pytest.fixture(scope="module")
def block_reference(blocks):
    return _block_run(blocks, blocks)


@pytest.mark.parametrize("recompute", [None, 1, 2, 4, "full", "recompute-all"])
def test_dropout_blocks_bitwise_equal_plain_autograd(blocks, block_reference, recompute):
    module = Recompute(blocks, recompute)
    out, grads, after = _block_run(blocks, module)
    assert torch.equal(out, block_reference[0]) and _equal(grads, block_reference[1])
    assert torch.equal(after, block_reference[2])  # the re-run did not move the caller's random stream
    assert module.stats.forwards == 6
    assert module.stats.recomputed == {None: 0, "recompute-all": 21}.get(recompute, 6)


@pytest.mark.parametrize("reentrant", [True, False])
def test_dropout_blocks_equal_torch_checkpoint_anchor(blocks, reentrant):
    ours = _block_run(blocks, Recompute(blocks, 2))
    anchor = _block_run(blocks, lambda x: checkpoint_sequential(blocks, 3, x, use_reentrant=reentrant))
    assert torch.equal(ours[0], anchor[0]) and _equal(ours[1], anchor[1]) and torch.equal(ours[2], anchor[2])


def test_autocast_is_replayed():
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.2)) for _ in range(4)])

    def run(module):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2)).requires_grad_()
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x)
        return torch.autograd.grad(out.float().sum(), [x, *layers.parameters()])

    assert _equal(list(run(Recompute(layers, 2))), list(run(layers)))


# -- the wrapper inside models ------------------------------------------------------------------


def _mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(10, 8, dtype=torch.float64), nn.Linear(8, 8, dtype=torch.float64), nn.GELU(),
                         nn.Linear(8, 8, dtype=torch.float64))


@pytest.mark.parametrize("recompute", [1, 2, "full", "recompute-all"])
def test_first_stage_input_needs_no_grad_parameters_only(recompute):
    model = _mlp(0)
    ids = torch.tensor([[1, 2, 3], [4, 5, 9]])
    plain = torch.autograd.grad(model(ids).sum(), list(model.parameters()))
    ours = torch.autograd.grad(Recompute(model, recompute)(ids).sum(), list(model.parameters()))
    assert _equal(list(ours), list(plain))


def test_frozen_and_parameter_free_layers():
    model = _mlp(1)
    model[1].weight.requires_grad_(False)
    x = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    chain = list(model)[1:]
    trainable = [p for p in model.parameters() if p.requires_grad][1:]
    plain = torch.autograd.grad(nn.Sequential(*chain)(x).sum(), [x, *trainable])
    for recompute in (1, "full", "recompute-all"):
        out = Recompute(chain, recompute)(x)
        assert _equal(list(torch.autograd.grad(out.sum(), [x, *trainable])), list(plain))
        assert model[1].weight.grad is None


def test_no_grad_runs_plainly_and_identity_chain_backpropagates():
    with torch.no_grad():
        out = Recompute([torch.tanh] * 4, 2)(torch.ones(3, requires_grad=True))
    assert out.grad_fn is None and torch.equal(out, torch.tanh(torch.tanh(torch.tanh(torch.tanh(torch.ones(3))))))
    x = torch.randn(3, requires_grad=True)
    Recompute([nn.Identity(), nn.Identity()], "full")(x).sum().backward()
    assert torch.equal(x.grad, torch.ones(3))


def test_functional_form_and_stage_helper(blocks, block_reference):
    out, grads, _ = _block_run(blocks, lambda x: recompute_sequential(blocks, x, "sqrt"))
    assert torch.equal(out, block_reference[0]) and _equal(grads, block_reference[1])
    stage = nn.Linear(2, 2)
    assert recompute_stage(stage, None) is stage
    assert recompute_stage(blocks, 3).plan == RecomputePlan("every-k", 6, 3)
    assert recompute_stage(stage, "full").plan == RecomputePlan("every-k", 1, 1)


def test_inside_threaded_pipe():
    pipeline = pytest.importorskip("modelpar.pipeline")
    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.Linear(8, 8, dtype=torch.float64), nn.Tanh())  # noqa: E731
    stages = [nn.Sequential(*[block() for _ in range(3)]) for _ in range(2)]
    x = torch.randn(12, 8, dtype=torch.float64)

    def grads(wrapped):
        with pipeline.Pipe(wrapped, split_size=4) as pipe:
            return torch.autograd.grad(pipe(x).sum(), [p for s in stages for p in s.parameters()])

    assert _equal(list(grads([recompute_stage(s, r) for s, r in zip(stages, [2, "full"])])), list(grads(stages)))


@pytest.mark.parametrize("recompute", [1, "full", "recompute-all"])
def test_inside_the_gpt_block_stack(recompute):
    model = pytest.importorskip("modelpar.model")
    cfg = model.ModelConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=4)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))

    def run(option):
        gpt = model.build_stage(cfg, recompute=option, dtype=torch.float64)
        out = gpt(ids)
        return [out.detach(), *torch.autograd.grad(out.square().sum(), list(gpt.parameters()))]

    assert _equal(run(recompute), run(None))


# -- selective recomputation: the attention core only (Korthikanti et al. 2022 §5) -------------------


def _attention_step(recompute_core: bool, dropout: float) -> tuple[list[torch.Tensor], int, int]:
    """Output and gradients of one causal attention block, and the activations it held (count, bytes)."""
    from modelpar.tensor_parallel import ParallelAttention

    torch.manual_seed(0)
    attn = ParallelAttention(32, 4, kv_heads=2, dropout=dropout, bias=False, rope_theta=1e4,
                             recompute_core=recompute_core, dtype=torch.float64)
    x = torch.randn(2, 16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    meter = ActivationMeter()
    torch.manual_seed(3)
    with meter:
        out = attn(x)
    held = meter.now
    grads = torch.autograd.grad((out * out).sum(), [x, *attn.parameters()])
    return [out.detach(), *grads, torch.rand(2)], held.count, held.bytes


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_selective_recomputation_keeps_less_and_gives_the_same_gradients(dropout):
    plain, plain_count, plain_bytes = _attention_step(False, dropout)
    ours, count, nbytes = _attention_step(True, dropout)
    assert _equal(ours, plain)  # output, input and weight gradients bitwise; the random stream untouched
    scores = 2 * 4 * 16 * 16 * 8  # one [b, a, s, s] float64 tensor
    if dropout:  # the explicit core keeps scores-sized tensors (probabilities, mask, dropped) for backward
        assert plain_bytes - nbytes >= 2 * scores and plain_count - count >= 2
    else:  # flash attention keeps no s² tensor, but still its output and row statistics
        assert nbytes < plain_bytes and count < plain_count


def test_selective_recomputation_in_the_model():
    model = pytest.importorskip("modelpar.model")
    cfg = model.ModelConfig(arch="llama", vocab_size=32, seq_len=8, hidden=16, heads=2, layers=2)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))

    def run(option):
        net = model.build_stage(cfg, recompute=option, dtype=torch.float64)
        out = net(ids)
        return [out.detach(), *torch.autograd.grad(out.square().sum(), list(net.parameters()))]

    assert _equal(run("selective"), run(None)) and _equal(run("none"), run(None))


def test_meter_counts_hand_checked_cases():
    meter = ActivationMeter()
    x = torch.randn(4, 3, requires_grad=True)
    lin = nn.Linear(3, 3)
    with meter:
        y = torch.tanh(lin(x))  # Linear saves x (its weight is a parameter: skipped), tanh saves y
        z = y * y  # saves y twice: the same storage, still one activation
    assert meter.now.count == 2 and meter.now.bytes == 2 * 4 * 3 * 4
    z.sum().backward()
    assert meter.now.count == 0 and meter.peak.count == 2
    with meter:
        w = torch.exp(x)
    meter.reset_peak()
    assert meter.now.count == 1 == meter.peak.count
    del w  # dropping the graph without backward releases it too
    assert meter.now.count == 0


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("recompute,match", [
    (0, r"recompute \(k, .*64-layer chain\) must be >= 1, got 0"),
    (65, r"recompute \(k, .*\) must be <= 64, got 65"),
    ("often", r"recompute must be None, an int k from 1 to 64, or one of 'none', 'full', 'sqrt', 'recompute-all'; got 'often'"),
    ("selective", r"recompute='selective' re-runs the attention core inside attention layers"),
    (2.5, r"got 2.5"),
    (True, r"got True"),
])
def test_bad_recompute_option(recompute, match):
    with pytest.raises(ValueError, match=match):
        Recompute(TANH_CHAIN, recompute)


@pytest.mark.parametrize("layers,match", [
    ([], r"layers must hold at least one layer, got an empty chain"),
    ([torch.tanh, 3], r"layers\[1\] must be callable .*got int"),
    (nn.Linear(2, 2), r"layers must be an nn.Sequential.*got Linear \(wrap a single module as \[module\]\)"),
    ("tanh", r"layers must be an nn.Sequential.*got str"),
])
def test_bad_chain(layers, match):
    with pytest.raises(ValueError, match=match):
        Recompute(layers, 1)


@pytest.mark.parametrize("recompute", [None, 1, "full", "recompute-all"])
def test_layer_returning_non_tensor(recompute):
    chain = Recompute([torch.tanh, lambda t: (t, t), torch.tanh], recompute)
    with pytest.raises(ValueError, match=r"layers\[1\] \(<lambda>\) returned tuple; .* one torch.Tensor"):
        chain(torch.ones(2, requires_grad=True))
    with pytest.raises(ValueError, match=r"input must be one torch.Tensor, got list"):
        chain([1.0, 2.0])


def test_plan_segments():
    assert plan_recompute(10, 4).segments == [(0, 4), (4, 8), (8, 10)]
    assert plan_recompute(10, None).segments == [] and plan_recompute(10, "full").label == "full"
    assert plan_recompute(64, "sqrt").label == "every-8" and plan_recompute(5, "recompute-all").label == "recompute-all"
    assert chain_cost(10, 4).held == max(1 + 4, 2 + 4, 3 + 2) == 6


# -- CUDA: the device generator is replayed too (skipped without a GPU) -------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("recompute", [2, "full", "recompute-all"])
def test_cuda_dropout_bitwise_and_random_stream_untouched(recompute):
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.3)) for _ in range(4)])
    layers = layers.to("cuda", torch.float64)

    def run(module):
        x = torch.randn(16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).cuda().requires_grad_()
        torch.manual_seed(5)  # seeds the CUDA generator too
        out = module(x)
        grads = torch.autograd.grad(out.sum(), [x, *layers.parameters()])
        return [out.detach(), *grads, torch.rand(4, device="cuda"), torch.rand(4)]

    assert _equal(run(Recompute(layers, recompute)), run(layers))


@pytest.mark.cuda
def test_cuda_autocast_is_replayed():
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.1)) for _ in range(4)]).cuda()

    def run(module):
        x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(2)).requires_grad_()
        torch.manual_seed(3)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = module(x)
        assert out.dtype == torch.bfloat16
        return list(torch.autograd.grad(out.float().sum(), [x, *layers.parameters()]))

    assert _equal(run(Recompute(layers, 2)), run(layers))


# -- the command line ---------------------------------------------------------------------------


def test_bench_recompute_command(capsys):
    from modelpar.cli import main

    assert main(["bench", "recompute", "--layers", "16", "--repeats", "0", "--strategies", "none,4,recompute-all"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows == [["none", "16", "16", "32", "0", "0", "True"], ["every-4", "8", "8", "16", "16", "12", "True"],
                    ["recompute-all", "2", "2", "4", "136", "135", "True"]]  # 16 x 32 float32: 2 KiB each
    assert main(["bench", "recompute", "--layers", "16", "--strategies", "none,17"]) == 2
    assert "recompute (k, layers per segment of a 16-layer chain) must be <= 16, got 17" in capsys.readouterr().err
    assert main(["bench", "recompute", "--strategies", ","]) == 2


# -- corner cases found in review -----------------------------------------------------------------


class _DoubleInPlace(nn.Module):
    def forward(self, x):
        return x.mul_(2)


@pytest.mark.parametrize("recompute", [2, "full", "recompute-all"])
def test_a_segment_that_modifies_its_input_in_place_is_refused(recompute):
    torch.manual_seed(0)
    layers = [_DoubleInPlace(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)]
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"layers\[0\] \(_DoubleInPlace\) modified its input in place"):
        Recompute(layers, recompute)(x)


@pytest.mark.parametrize("recompute", [1, 2, "full", "recompute-all"])
def test_batchnorm_running_statistics_updated_once_as_in_plain_autograd(recompute):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4))
    ours = copy.deepcopy(plain)
    x = torch.randn(8, 4)
    plain(x).sum().backward()
    Recompute(ours, recompute)(x).sum().backward()
    for a, b in zip(plain.buffers(), ours.buffers()):
        assert torch.equal(a, b)  # running_mean, running_var, num_batches_tracked
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), ours.parameters()))


@pytest.mark.parametrize("recompute", [2, "recompute-all"])
def test_double_backward_is_a_clear_error(recompute):
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y = Recompute([nn.Linear(4, 4).double(), nn.Tanh(), nn.Linear(4, 1).double()], recompute)(x).sum()
    (g,) = torch.autograd.grad(y, x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        torch.autograd.grad(g.sum(), x)


@pytest.mark.numerics
def test_recompute_all_sums_a_parameter_shared_by_several_layers():
    torch.manual_seed(0)
    shared = nn.Linear(4, 4).double()
    layers = [shared, nn.Tanh(), shared, nn.Tanh(), shared]
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    plain = torch.autograd.grad(nn.Sequential(*layers)(x).sum(), [x, shared.weight])
    ours = torch.autograd.grad(Recompute(layers, "recompute-all")(x).sum(), [x, shared.weight])
    assert all(torch.allclose(a, b, rtol=1e-13, atol=1e-13) for a, b in zip(plain, ours))
