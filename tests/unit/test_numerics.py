"""Precision, gradient buckets and ZeRO-1's ranges, in one process (the distributed runs are in test_train.py)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from modelpar.tensor_parallel.sharding import ParamLayout
from modelpar.training.buckets import build_buckets
from modelpar.training.precision import MixedPrecisionStage, check_precision, compute_dtype, param_dtype, wrap_stage
from modelpar.training.zero import flat_boxes, segment_shard


# --- precision ------------------------------------------------------------------------------------
def test_precisions_and_the_refused_fp16():
    assert [(param_dtype(p), compute_dtype(p)) for p in ("fp32", "bf16", "fp64")] == [
        (torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float64, torch.float64)]
    with pytest.raises(ValueError, match=r"precision 'fp16' is not supported: fp16 needs loss scaling.*use bf16"):
        check_precision("fp16")
    with pytest.raises(ValueError, match=r"precision must be one of \{fp32, bf16, fp8, fp64\}, got 'float32'"):
        check_precision("float32")


def _bf16_error_bound(mlp: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """A first-order worst-case bound on |bf16 - fp32| for Linear-GELU-Linear, from bf16's 8 significant bits.

    With unit roundoff u = 2^-8, an n-term dot product whose factors are rounded to bf16 and whose partial
    sums may be rounded too (the worst kernel) is off by at most (n + 2)·u·Σ|w·x| (Higham, Accuracy and
    Stability, §3.1); GELU's slope stays under 1.13 and rounding its output adds u|g|.
    """
    (w1, b1), (w2, b2) = ((m.weight.abs(), m.bias.abs()) for m in (mlp[0], mlp[2]))
    u, n = 2.0**-8, w1.shape[1]
    g = mlp[1](mlp[0](x.float())).abs()  # the hidden activation's magnitude
    first = (n + 2) * u * (x.float().abs() @ w1.T + b1)  # error of the first layer's output
    return (1.13 * first + u * g) @ w2.T + (n + 2) * u * (g @ w2.T + b2)


@pytest.mark.numerics
def test_a_bf16_stage_computes_in_bf16_and_keeps_fp32_parameters_and_gradients():
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    assert wrap_stage(inner, "fp32", last=False) is inner
    stage = wrap_stage(inner, "bf16", last=False)
    assert isinstance(stage, MixedPrecisionStage) and list(stage.parameters()) == list(inner.parameters())
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)  # an activation received in bf16
    y = stage(x)
    assert y.dtype == torch.bfloat16  # the message to the next stage: half the bytes
    y.float().pow(2).sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16  # the gradient sent back
    assert all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
               for p in inner.parameters())
    with torch.no_grad():
        want = inner(x.float())
        assert 0 < (y.float() - want).abs().max() and ((y.float() - want).abs() <= _bf16_error_bound(inner, x)).all()
    last = wrap_stage(nn.Linear(8, 5), "bf16", last=True)
    assert last(torch.randn(2, 8)).dtype == torch.bfloat16  # logits as autocast left them; the loss upcasts


# --- buckets --------------------------------------------------------------------------------------
def test_buckets_hold_a_stage_each_in_backward_order_with_views_and_padding():
    torch.manual_seed(0)
    a, b = nn.Linear(3, 4), nn.Linear(4, 2)  # stage 0: a (16 elements), stage 1: b (10)
    tied = nn.Parameter(torch.randn(5))
    b.register_parameter("tied", tied)
    before = {id(p): p.detach().clone() for m in (a, b) for p in m.parameters()}
    partial = {id(a.bias)}
    buckets = build_buckets([(1, b), (0, a)], elements=12, shards=3, partial=lambda p: id(p) in partial, tied=[tied])
    got = [(k.stage, k.ready, [tuple(p.shape) for p in k.params], k.numel, k.size) for k in buckets]
    assert got == [(1, "backward", [(2,), (2, 4)], 10, 12),  # stage 1 first: its backward ends first
                   (0, "backward", [(4, 3)], 12, 12),
                   (0, "stage", [(4,)], 4, 6),  # the tensor-parallel partial gradient: its own bucket
                   (1, "step", [(5,)], 5, 6)]  # the tied copy, reduced after the pipeline step
    for k in buckets:
        for p, offset in zip(k.params, k.offsets):
            assert torch.equal(p, before[id(p)])  # same values, now views into the buffers
            assert p.data_ptr() == k.data[offset:].data_ptr() and p.grad.data_ptr() == k.grad[offset:].data_ptr()
    b(a(torch.ones(2, 3))).sum().backward()
    b(a(torch.ones(2, 3))).sum().backward()  # accumulates in place, in the buffers
    assert torch.equal(buckets[0].grad[:2], torch.full((2,), 4.0)) and buckets[0].shard_range(2, 3) == (8, 12)


# --- ZeRO-1 ranges as boxes of the tensor ---------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data())
def test_a_flat_range_is_a_few_contiguous_boxes_covering_it_exactly(shape, data):
    n = math.prod(shape)
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start + 1, n))
    full = torch.arange(n).view(shape)
    boxes = flat_boxes(shape, start, stop)
    assert len(boxes) <= 2 * len(shape) - 1
    covered = []
    for offsets, sizes, flat in boxes:
        box = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        assert box.flatten().tolist() == list(range(flat, flat + box.numel()))  # contiguous, starting at flat
        covered += box.flatten().tolist()
    assert covered == list(range(start, stop))


@settings(max_examples=150, deadline=None)
@given(dim=st.sampled_from([None, 0, 1]), blocks=st.sampled_from([1, 3]), world=st.sampled_from([1, 2, 4]),
       replicas=st.sampled_from([1, 2]), data=st.data())
def test_a_range_of_a_tensor_parallel_shard_is_boxes_of_the_full_tensor(dim, blocks, world, replicas, data):
    if replicas > world or (dim != 0 and blocks > 1):
        return
    rank = data.draw(st.integers(0, world - 1))
    layout = ParamLayout(dim, blocks if dim is not None else 1, replicas if dim is not None else 1, rank, world)
    full = torch.arange(12 * 8, dtype=torch.float64).view(12, 8)  # rows: 3 blocks x 4 shards; columns: 4 shards
    local = layout.shard_of(full)
    start = data.draw(st.integers(0, local.numel() - 1))
    stop = data.draw(st.integers(start + 1, local.numel()))
    shard = segment_shard(local.flatten()[start:stop].clone(), local.shape, start, stop, layout)
    assert shard.shape == (12, 8) and sum(p.tensor.numel() for p in shard.pieces) == stop - start
    for piece in shard.pieces:  # each box holds exactly the full tensor's values at its place
        box = full[tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.tensor.shape))]
        assert torch.equal(piece.tensor, box)


@pytest.mark.cuda
def test_bf16_and_zero1_train_on_one_gpu_like_fp32():
    """NCCL world of one: autocast on CUDA, fused AdamW (step counts on the GPU), ZeRO-1's ranges."""
    import dataclasses

    import torch.distributed as dist

    from modelpar.distributed import free_port
    from modelpar.model import ModelConfig
    from modelpar.training import TrainConfig, train

    cfg = TrainConfig(model=ModelConfig(arch="llama", hidden=64, heads=4, kv_heads=2, layers=2, seq_len=32),
                      tp=1, pp=1, dp=1, steps=20, batch_size=8, microbatches=2, warmup=2, lr=3e-3, eval_every=0,
                      eval_batches=1)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        fp32 = train(cfg).losses
        bf16 = train(dataclasses.replace(cfg, precision="bf16", zero=1, bucket_mb=0.01)).losses
    finally:
        dist.destroy_process_group()
    assert max(abs(a - b) for a, b in zip(fp32, bf16)) < 0.05 and bf16[-1] < bf16[0] - 1.0
