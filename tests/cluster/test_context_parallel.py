"""Context parallelism at cp = 2: the attention core against torch's attention, and training against one process.

The core's pieces are checked in this process (the zig-zag split, the log-sum-exp merge against a
direct softmax, every rank's share against ``scaled_dot_product_attention`` on the whole sequence);
the ring and all-gather autograd on 2 real gloo ranks (one cluster for the module), float64,
forward and gradients at 1e-12; then ``train`` with cp = 2 against the plain one-process loop.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import plain_loop

from modelpar.checkpoint import latest_checkpoint
from modelpar.model import ModelConfig
from modelpar.tensor_parallel.context_parallel import (
    ContextParallel,
    attend_chunks,
    block_attention,
    check_context_split,
    chunks_of,
    context_attention,
    merge,
    zigzag_index,
)
from modelpar.training import TrainConfig, train

TINY = ModelConfig(hidden=32, heads=4, layers=2, seq_len=16)
LLAMA = ModelConfig(arch="llama", hidden=32, heads=4, kv_heads=2, layers=2, seq_len=16)
BASE = TrainConfig(model=TINY, steps=3, batch_size=4, microbatches=2, precision="fp64", warmup=1, lr=1e-2,
                   clip=0.5, eval_every=0, eval_batches=1, tp=1, pp=1, dp=1, cp=2)
TOL = 1e-9


def test_zigzag_split_by_hand():
    assert zigzag_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert zigzag_index(12, 3, 1).tolist() == [2, 3, 8, 9]
    assert zigzag_index(6, 1, 0).tolist() == list(range(6))
    with pytest.raises(ValueError, match=r"seq_len \(10\) must be divisible by 2 \* cp \(4\)"):
        check_context_split(10, 2)


@given(cp=st.integers(1, 6), chunk=st.integers(1, 5))
@settings(max_examples=40, deadline=None)
def test_zigzag_partitions_the_sequence_and_balances_causal_work(cp, chunk):
    s = 2 * cp * chunk
    parts = [zigzag_index(s, cp, r) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(s))
    work = {int((p + 1).sum()) for p in parts}  # (query, key) pairs under the causal mask
    assert len(work) == 1


def _qkv(b=2, a=4, g=2, s=16, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, a, s, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, g, s, d, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v


def test_merge_equals_a_direct_softmax():
    q, k, v = _qkv(g=4)
    pos_q = torch.arange(16)
    blocks = [torch.tensor([3, 0, 9, 15]), torch.tensor([1, 2, 4, 5, 6]), torch.tensor([7, 8, 10, 11, 12, 13, 14])]
    out = lse = None
    for pos_k in blocks:  # any order, any sizes: the merge is associative and commutative
        o, m = block_attention(q, k[:, :, pos_k], v[:, :, pos_k], 8 ** -0.5, pos_q[:, None] >= pos_k[None, :])
        out, lse = (o, m) if out is None else merge(out, lse, o, m)
    scores = (q @ k.transpose(-2, -1)) * 8 ** -0.5
    scores = scores.masked_fill(~torch.ones(16, 16, dtype=torch.bool).tril(), float("-inf"))
    assert torch.allclose(out, scores.softmax(-1) @ v, rtol=0, atol=1e-14)
    assert torch.allclose(lse, scores.logsumexp(-1), rtol=0, atol=1e-14)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_every_ranks_share_equals_sdpa_on_the_whole_sequence(cp):
    q, k, v = _qkv()
    full = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    parts = [zigzag_index(16, cp, r) for r in range(cp)]
    for r in range(cp):
        out = lse = None
        for i in range(cp):  # the ring's order: own block first, then rank r-1's, ...
            src = parts[(r - i) % cp]
            o, m = attend_chunks(q[:, :, parts[r]], k[:, :, src].repeat_interleave(2, 1),
                                 v[:, :, src].repeat_interleave(2, 1), chunks_of(r, cp), chunks_of((r - i) % cp, cp),
                                 8 ** -0.5)
            out, lse = (o, m) if out is None else merge(out, lse, o, m)
        assert torch.allclose(out, full[:, :, parts[r]], rtol=0, atol=1e-14)


@pytest.mark.parametrize("comm", ["ring", "allgather"])
def test_the_core_on_one_rank_is_sdpa_forward_and_backward(comm):
    q, k, v = (t.requires_grad_() for t in _qkv())
    out = context_attention(q, k, v, ContextParallel(None, comm))
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    grad = torch.randn_like(out)
    mine, theirs = (torch.autograd.grad(o, (q, k, v), grad) for o in (out, ref))
    assert torch.allclose(out, ref, rtol=0, atol=1e-14)
    for a, b in zip(mine, theirs):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def _core_on_ranks(comm):
    """This cp rank's output and gradients of the core on its zig-zag share, and the full reference's."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    q, k, v = _qkv()
    grad = torch.randn(2, 4, 16, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(full[0], full[1].repeat_interleave(2, 1), full[2].repeat_interleave(2, 1),
                                         is_causal=True)
    ref.backward(grad)
    mine = zigzag_index(16, 2, dist.get_rank())
    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    out = context_attention(*local, ContextParallel(dist.group.WORLD, comm))
    out.backward(grad[:, :, mine])
    errors = [(out - ref[:, :, mine]).abs().max().item()]
    errors += [(t.grad - f.grad[:, :, mine]).abs().max().item() for t, f in zip(local, full)]
    return errors


@pytest.mark.parametrize("comm", ["ring", "allgather"])
def test_the_core_on_two_ranks_equals_one_process_forward_and_gradients(c2, comm):
    for errors in c2.run(_core_on_ranks, comm):
        assert max(errors) <= 1e-12, errors


def _train(cfg):
    torch.set_num_threads(1)
    r = train(cfg)
    return r.losses, r.grad_norms, r.val[-1][1]


def _check(cluster, cfg):
    ref = plain_loop(cfg)
    for losses, norms, val in cluster.run(_train, cfg):
        assert max(abs(a - b) for a, b in zip(losses, ref.losses)) <= TOL
        assert max(abs(a - b) for a, b in zip(norms, ref.norms)) <= TOL
        assert abs(val - ref.val) <= TOL


@pytest.mark.parametrize("changes", [{}, {"cp_comm": "allgather"}, {"model": LLAMA},
                                     {"model": LLAMA, "cp_comm": "allgather", "recompute": "selective"}],
                         ids=["gpt-ring", "gpt-allgather", "llama-gqa-ring", "llama-gqa-allgather-selective"])
def test_cp2_trains_the_single_process_model(c2, changes):
    _check(c2, dataclasses.replace(BASE, **changes))


def _try(cfg):
    try:
        return train(cfg).losses
    except ValueError as err:
        return str(err)


def test_a_sequence_not_split_in_2cp_chunks_is_refused_on_every_rank(c2):
    cfg = dataclasses.replace(BASE, model=dataclasses.replace(TINY, seq_len=18))
    assert c2.run(_try, cfg) == ["seq_len (18) must be divisible by 2 * cp (4): context parallelism splits every "
                                 "sequence into 2·cp equal chunks (no padding)"] * 2


@pytest.mark.parametrize("first, then", [({"cp": 2}, {"cp": 1, "dp": 2}), ({"cp": 1, "dp": 2}, {"cp": 2, "dp": 1})])
def test_checkpoints_move_between_cp_and_no_cp(c2, tmp_path, first, then):
    """A cp = 2 run's checkpoint resumes on d = 2 (cp = 1) and back; both end on the plain loop's losses."""
    cfg = dataclasses.replace(BASE, steps=4, checkpoint_dir=str(tmp_path), **first)
    c2.run(_train, dataclasses.replace(cfg, exit_after=2))
    assert latest_checkpoint(str(tmp_path)) is not None
    resumed = dataclasses.replace(cfg, resume=True, **then)
    ref = plain_loop(cfg)
    for losses, _, _ in c2.run(_train, resumed):
        assert len(losses) == 4
        assert max(abs(a - b) for a, b in zip(losses, ref.losses)) <= TOL
