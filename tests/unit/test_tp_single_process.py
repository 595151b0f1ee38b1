"""Tensor-parallel pieces that need no processes: §5.1–5.2 facts, sharding, dropout, bad input."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import modelpar.tensor_parallel as tp
from modelpar.tensor_parallel.accounting import CommRecord

pytestmark = pytest.mark.numerics  # float64 errors of a few ulps


# --- §5.1 / §5.2: the reference's numbers ---------------------------------------------------
def test_matmul_splits_exact_but_gelu_does_not_distribute():
    facts = tp.matmul_splits()  # seed 0, X 2×8, A 8×64
    # a few ulps of values ~1: the exact figure depends on the BLAS summation order (reference: 8.9e-16)
    assert facts["column_error"] <= 4e-15 and facts["row_error"] <= 4e-15
    assert facts["gelu_gap"] == pytest.approx(3.3, abs=0.05)  # reference: "差 3.3"


@pytest.mark.parametrize("t", [2, 4, 8])
def test_column_then_row_mlp_is_exact_and_rank0_alone_is_not(t):
    facts = tp.mlp_splits(t)
    assert facts["error"] < 5e-15  # reference: "2e-15 量级"
    assert facts["partial_gap"] == pytest.approx(2.0, abs=0.2)  # reference: "差约 2"
    assert facts["weight_fraction"] == 1 / t


@settings(max_examples=25, deadline=None)
@given(t=st.sampled_from([1, 2, 4]), seed=st.integers(0, 1000), rows=st.integers(1, 5), hidden=st.sampled_from([4, 8, 12]))
def test_mlp_split_exact_property(t, seed, rows, hidden):
    facts = tp.mlp_splits(t, seed=seed, rows=rows, hidden=hidden)
    assert facts["error"] < 1e-13
    assert (facts["partial_gap"] == 0.0) == (t == 1)


# --- sharding ---------------------------------------------------------------------------------
def test_shard_tensor_hand_checked_with_blocks():
    full = torch.arange(12).view(12, 1)  # [q0 q1 q2 q3 | k0 .. k3 | v0 .. v3], 2 ranks, 3 fused blocks
    assert tp.shard_tensor(full, 0, 0, 2, blocks=3).flatten().tolist() == [0, 1, 4, 5, 8, 9]
    assert tp.shard_tensor(full, 0, 1, 2, blocks=3).flatten().tolist() == [2, 3, 6, 7, 10, 11]
    assert tp.shard_tensor(torch.arange(6).view(2, 3), 1, 2, 3).tolist() == [[2], [5]]


@settings(max_examples=40, deadline=None)
@given(world=st.sampled_from([1, 2, 4]), blocks=st.sampled_from([1, 3]), dim=st.sampled_from([0, 1, -1]),
       other=st.integers(1, 3), mult=st.integers(1, 2))
def test_unshard_inverts_shard(world, blocks, dim, other, mult):
    size = world * blocks * mult
    shape = [size, other] if dim == 0 else [other, size]
    full = torch.randn(shape)
    shards = [tp.shard_tensor(full, dim, r, world, blocks) for r in range(world)]
    assert all(s.shape[dim] == size // world for s in shards)
    assert torch.equal(tp.unshard_tensor(shards, dim, blocks), full)


def test_param_layout_hand_checked_for_replicated_key_value_heads():
    # t = 4 ranks, 2 kv heads of 1 row each in [Wk; Wv]: ranks 0, 1 hold head 0, ranks 2, 3 head 1
    full = torch.arange(4).view(4, 1)  # [k0 k1 | v0 v1]
    layouts = [tp.ParamLayout(0, blocks=2, replicas=2, rank=r, world=4) for r in range(4)]
    assert [lay.shard_of(full).flatten().tolist() for lay in layouts] == [[0, 2], [0, 2], [1, 3], [1, 3]]
    assert [(lay.shards, lay.shard, lay.partial_grad) for lay in layouts[1:3]] == [(2, 0, True), (2, 1, True)]
    assert layouts[2].pieces(4) == [(0, 1, 1), (1, 3, 1)]  # (in the shard, in the full tensor, length) per block
    assert layouts[2].full_shape((2, 1)) == (4, 1)
    plain = tp.param_layout(torch.nn.Parameter(torch.zeros(3)))
    assert plain == tp.ParamLayout() and plain.shard_of(full) is full and not plain.partial_grad
    assert tp.ParamLayout(None, sequence_parallel=True, world=2).partial_grad


@settings(max_examples=30, deadline=None)
@given(kv=st.sampled_from([1, 2, 4, 8]), t=st.sampled_from([1, 2, 4, 8]), blocks=st.sampled_from([1, 2, 3]))
def test_layout_pieces_tile_the_full_tensor(kv, t, blocks):
    if kv % t and t % kv:
        return
    replicas = max(1, t // kv)
    full = torch.arange(blocks * kv * 2).view(-1, 1)  # kv heads of 2 rows, per block
    seen = set()
    for r in range(t):
        layout = tp.ParamLayout(0, blocks, replicas, rank=r, world=t)
        shard = layout.shard_of(full)
        for local, start, length in layout.pieces(full.shape[0]):
            assert torch.equal(shard[local:local + length], full[start:start + length])
            seen.update(range(start, start + length))
    assert seen == set(range(full.shape[0]))  # every row held by some rank


def test_shard_tensor_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"dimension 0 .* \(10\) must be divisible by world \* blocks = 4 \* 1"):
        tp.shard_tensor(torch.zeros(10), 0, 0, 4)
    with pytest.raises(ValueError, match=r"rank must be <= 1, got 2"):
        tp.shard_tensor(torch.zeros(4), 0, 2, 2)


def test_pad_vocab_size_as_megatron():
    assert tp.pad_vocab_size(50257, 8) == 50264
    assert tp.pad_vocab_size(50257, 1, multiple=128) == 50304  # GPT-2's padded vocabulary in Megatron
    assert tp.pad_vocab_size(128256, 1, multiple=128) == 128256  # LLaMA-3: already a multiple of 128
    assert tp.pad_vocab_size(128256, 8, multiple=128) == 129024


# --- single-process references, meta device ------------------------------------------------------
def test_group_none_layers_are_the_plain_torch_modules():
    torch.manual_seed(0)
    col, lin = tp.ColumnParallelLinear(6, 4, dtype=torch.float64), nn.Linear(6, 4, dtype=torch.float64)
    lin.load_state_dict(col.state_dict())
    x = torch.randn(3, 6, dtype=torch.float64)
    assert torch.equal(col(x), lin(x))
    emb, ref = tp.VocabParallelEmbedding(10, 4), nn.Embedding(10, 4)
    ref.load_state_dict(emb.state_dict())
    ids = torch.tensor([[0, 9, 3]])
    assert torch.equal(emb(ids), ref(ids))


def test_meta_construction_keeps_split_info_after_to_empty():
    layer = tp.ParallelTransformerLayer(16, 4, device="meta")
    assert layer.mlp.fc1.weight.is_meta
    layer.to_empty(device="cpu")
    assert tp.param_layout(layer.attn.qkv.weight) == tp.ParamLayout(0, blocks=3)
    assert tp.param_layout(layer.attn.proj.weight).dim == 1 and tp.param_layout(layer.ln1.weight).dim is None
    llama = tp.ParallelTransformerLayer(16, 4, llama=True, kv_heads=2, device="meta").to_empty(device="cpu")
    assert tp.param_layout(llama.attn.kv.weight).blocks == 2 == tp.param_layout(llama.mlp.fc1.weight).blocks
    full = tp.ParallelTransformerLayer(16, 4).state_dict()
    tp.load_full_state_dict(layer, full)
    assert all(torch.equal(layer.state_dict()[k], v) for k, v in full.items())


def test_load_full_state_dict_names_the_problem():
    layer = tp.ParallelMLP(8)
    with pytest.raises(ValueError, match=r"missing keys \['fc1.bias'\]"):
        tp.load_full_state_dict(layer, {k: v for k, v in layer.state_dict().items() if k != "fc1.bias"})
    bad = dict(layer.state_dict(), **{"fc2.weight": torch.zeros(8, 30)})
    with pytest.raises(ValueError, match=r"'fc2.weight' has shape \(8, 30\)"):
        tp.load_full_state_dict(layer, bad)


# --- dropout ----------------------------------------------------------------------------------------
def test_sliced_dropout_is_F_dropout_and_slices_the_full_mask():
    x = torch.ones(2, 8, 4, dtype=torch.float64)
    torch.manual_seed(5)
    expected = F.dropout(x, 0.3, training=True)
    torch.manual_seed(5)
    assert torch.equal(tp.sliced_dropout(x, 0.3, True), expected)
    shards = []
    for r in range(4):
        torch.manual_seed(5)
        shards.append(tp.sliced_dropout(x[:, :2], 0.3, True, dim=1, rank=r, world=4))
    assert torch.equal(torch.cat(shards, 1), expected)
    assert tp.sliced_dropout(x, 0.3, False) is x


# --- cross entropy and bad input on one process -------------------------------------------------------
def test_cross_entropy_single_process_and_16_bit_logits():
    torch.manual_seed(0)
    logits = torch.randn(5, 7, dtype=torch.bfloat16, requires_grad=True)
    target = torch.tensor([1, -100, 6, 0, 3])
    ours = tp.vocab_parallel_cross_entropy(logits, target)
    assert ours.dtype == torch.float32
    ref = F.cross_entropy(logits.float(), target)
    assert ours.item() == pytest.approx(ref.item(), abs=1e-6)
    ours.backward()
    assert logits.grad[1].abs().max().item() == 0.0


@pytest.mark.parametrize("build,match", [
    (lambda: tp.ParallelAttention(10, 4), r"hidden \(10\) must be divisible by heads \(4\)"),
    (lambda: tp.ParallelAttention(8, 2, dropout=1.0), r"dropout must be < 1, got 1.0"),
    (lambda: tp.ColumnParallelLinear(4, 6, blocks=4),
     r"out_features \(6\) must be divisible by blocks \* shards = 4 \* 1"),
    (lambda: tp.ColumnParallelLinear(4, 6, gather_output=True, blocks=3), r"gather_output=True needs blocks=1"),
    (lambda: tp.ColumnParallelLinear(4, 6, replicas=2), r"the tensor-parallel size t \(1\) must be divisible by replicas \(2\)"),
    (lambda: tp.ParallelAttention(16, 4, kv_heads=3), r"heads \(4\) must be divisible by kv_heads \(3\)"),
    (lambda: tp.ParallelAttention(12, 4, kv_heads=2, rope_theta=1e4)(torch.zeros(1, 2, 12)),
     r"rotary embedding needs an even head dimension, got 3"),
    (lambda: tp.vocab_parallel_cross_entropy(torch.zeros(3, 4), torch.tensor([0, 1, 3]), vocab_size=3),
     r"target must be in \[0, 3\) or -100, got 3"),
    (lambda: tp.vocab_parallel_cross_entropy(torch.zeros(3, 4), torch.tensor([0, 1, 2]), vocab_size=5),
     r"vocab_size must be <= 4, got 5"),
    (lambda: tp.RowParallelLinear(4, 6, input_is_parallel=False, sequence_parallel=True), r"needs input_is_parallel=True"),
    (lambda: tp.ColumnParallelLinear(0, 6), r"in_features must be >= 1, got 0"),
    (lambda: tp.VocabParallelEmbedding(5, 2)(torch.tensor([5])), r"ids must be in \[0, 5\), got 5"),
    (lambda: tp.VocabParallelEmbedding(5, 2)(torch.tensor([0.5])), r"ids must be an integer tensor"),
    (lambda: tp.vocab_parallel_cross_entropy(torch.zeros(3, 4), torch.zeros(2, dtype=torch.long)),
     r"target must have the shape .* \(3,\), got \(2,\)"),
    (lambda: tp.vocab_parallel_cross_entropy(torch.zeros(3, 4), torch.zeros(3, dtype=torch.long), reduction="avg"),
     r"reduction must be one of \{mean, sum, none\}, got 'avg'"),
])
def test_bad_input_single_process(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_group_without_torch_distributed_is_an_error():
    class FakeGroup:  # anything but None needs an initialised process group
        pass
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        tp.ColumnParallelLinear(4, 4, group=FakeGroup())


# --- Llama blocks on one process ---------------------------------------------------------------------
def test_rms_norm_and_rotary_hand_checked():
    norm = tp.RMSNorm(2, eps=0.0, dtype=torch.float64)
    assert norm(torch.tensor([3.0, 4.0], dtype=torch.float64)).tolist() == pytest.approx([3 / 12.5**0.5, 4 / 12.5**0.5])
    cos, sin = tp.rotary.rotary_angles(torch.arange(3), 4, 100.0, torch.float64)
    assert cos[2].tolist() == pytest.approx([math.cos(2), math.cos(0.2), math.cos(2), math.cos(0.2)])  # θ_i = p/100^(2i/4)
    # q·k after rotation depends on the positions' difference only
    torch.manual_seed(0)
    q, k = torch.randn(2, 1, 1, 8, dtype=torch.float64)
    dot = []
    for shift in (0, 5):
        cos, sin = tp.rotary.rotary_angles(torch.tensor([3 + shift, 1 + shift]), 8, 1e4, torch.float64)
        dot.append((tp.rotary.apply_rotary(q, cos[:1], sin[:1]) * tp.rotary.apply_rotary(k, cos[1:], sin[1:])).sum())
    assert dot[0].item() == pytest.approx(dot[1].item(), abs=1e-12)


def test_grouped_query_attention_is_multi_head_attention_with_shared_heads():
    torch.manual_seed(0)
    gqa = tp.ParallelAttention(16, 4, kv_heads=2, bias=False, rope_theta=1e4, dtype=torch.float64)
    mha = tp.ParallelAttention(16, 4, kv_heads=4, bias=False, rope_theta=1e4, dtype=torch.float64)
    wk, wv = gqa.kv.weight.detach().chunk(2)
    repeat = lambda w: w.view(2, 1, 4, 16).expand(2, 2, 4, 16).reshape(16, 16)  # noqa: E731 heads 0,0,1,1
    mha.load_state_dict({"q.weight": gqa.q.weight, "kv.weight": torch.cat([repeat(wk), repeat(wv)]),
                         "proj.weight": gqa.proj.weight})
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(gqa(x), mha(x), rtol=0, atol=1e-14)


def test_comm_log_is_scoped_to_its_block_and_thread():
    import threading

    from _wait import join

    from modelpar.tensor_parallel.accounting import record

    with tp.comm_log() as outer:
        record("all_reduce", "forward", 4, 8, 2)
        worker = threading.Thread(target=record, args=("all_gather", "forward", 4, 8, 2))
        worker.start()
        join(worker)  # another thread's collective is not this block's
        with tp.comm_log() as inner:
            record("reduce_scatter", "backward", 2, 8, 2)
    record("all_reduce", "forward", 1, 8, 2)  # after the block: recorded nowhere
    assert [r.kind for r in outer.records] == ["all_reduce", "reduce_scatter"]
    assert [r.kind for r in inner.records] == ["reduce_scatter"]


def test_shape_checks_are_a_per_module_switch():
    a, b = tp.ParallelTransformerLayer(8, 2), tp.ParallelTransformerLayer(8, 2)
    tp.set_shape_checks(a, False)
    assert not any(m.check_shapes for m in a.modules() if isinstance(m, tp.TensorParallelModule))
    assert all(m.check_shapes for m in b.modules() if isinstance(m, tp.TensorParallelModule))


def test_comm_record_ring_bytes():
    assert CommRecord("all_reduce", "forward", 10, 80, 4).sent_bytes == 2 * 3 / 4 * 80
    assert CommRecord("reduce_scatter", "forward", 10, 80, 4).sent_bytes == 3 / 4 * 80
