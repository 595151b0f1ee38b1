"""Megatron tensor parallelism on real gloo processes, float64, against the single-process modules.

One c4 of 4 ranks serves the module; t = 2 runs on sub-groups [0, 1] and [2, 3], t = 1 on
group=None (the reference itself, through the parallel code path). The functions above the
tests run on every rank: each builds the single-process module (group=None) and the t-rank one
from the same full weights, runs both on the same float64 input and returns the differences.
"""

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import modelpar.tensor_parallel as tp
from modelpar.tensor_parallel import collectives

B, S, H, HEADS, VOCAB = 2, 8, 16, 4, 32
LLAMA_H, LLAMA_HEADS = 32, 8  # head dimension 4 (rotary needs an even one); kv heads 1, 2, 4 or 8
_GROUPS: dict[object, object] = {}


def tp_group(t: int):
    """This rank's group of t consecutive ranks (None for t = 1); every rank creates every group."""
    if t == 1:
        return None
    if t not in _GROUPS:
        world, me = dist.get_world_size(), dist.get_rank()
        for start in range(0, world, t):
            g = dist.new_group(list(range(start, start + t)))
            if start <= me < start + t:
                _GROUPS[t] = g
    return _GROUPS[t]


def build(kind: str, group, sp: bool, **kw):
    torch.manual_seed(0)
    f64 = {"dtype": torch.float64, "group": group}
    if kind == "column":
        return tp.ColumnParallelLinear(H, 3 * H, sequence_parallel=sp, **f64, **kw)
    if kind == "row":
        return tp.RowParallelLinear(3 * H, H, sequence_parallel=sp, **f64, **kw)
    if kind == "embedding":
        return tp.VocabParallelEmbedding(VOCAB, H, sequence_parallel=sp, **f64)
    if kind == "mlp":
        return tp.ParallelMLP(H, sequence_parallel=sp, **f64)
    if kind == "attention":
        return tp.ParallelAttention(H, HEADS, sequence_parallel=sp, **f64, **kw)
    if kind == "llama_attention":
        return tp.ParallelAttention(LLAMA_H, LLAMA_HEADS, bias=False, rope_theta=1e4, sequence_parallel=sp, **f64, **kw)
    if kind == "llama_layer":
        return tp.ParallelTransformerLayer(LLAMA_H, LLAMA_HEADS, llama=True, sequence_parallel=sp, **f64, **kw)
    return tp.ParallelTransformerLayer(H, HEADS, sequence_parallel=sp, **f64, **kw)


def _input(kind: str) -> torch.Tensor:
    torch.manual_seed(1)
    if kind == "embedding":
        return torch.randint(0, VOCAB, (B, S))
    width = {"row": 3 * H, "llama_attention": LLAMA_H, "llama_layer": LLAMA_H}.get(kind, H)
    return torch.randn(B, S, width, dtype=torch.float64)


def _shard_in(kind, x, group, sp, kw):
    """The parallel module's input: x, its sequence shard (SP) or its last-dim shard (row, parallel input)."""
    t, r = tp._comm.group_size(group), tp._comm.group_rank(group)
    if sp and kind not in ("embedding", "row"):
        return tp.shard_tensor(x, 1, r, t)
    if kind == "row" and kw.get("input_is_parallel", True):
        return tp.shard_tensor(x, -1, r, t)
    return x.clone()


def transparency(kind: str, t: int, sp: bool = False, count: bool = False, **kw):
    """Max |parallel − single process| over the output, the input gradient and every parameter gradient
    (with dropout on, also how much of the output the masks changed: they must have dropped something)."""
    group = tp_group(t)
    tr, tw = tp._comm.group_rank(group), tp._comm.group_size(group)
    ref, par = build(kind, None, False, **kw), build(kind, group, sp, **kw)
    tp.load_full_state_dict(par, ref.state_dict())
    x = _input(kind)
    xr, xp = x.clone(), _shard_in(kind, x, group, sp, kw)
    if x.is_floating_point():
        xr.requires_grad_(True)
        xp.requires_grad_(True)
    torch.manual_seed(2)
    out_ref = ref(xr)
    w = torch.randn(out_ref.shape, dtype=torch.float64)  # a loss that weighs every output differently
    (out_ref * w).sum().backward()
    with tp.comm_log() as fwd:
        torch.manual_seed(2)  # the same dropout masks as the single-process run
        out_par = par(xp)
    # which slice of the single-process output this rank holds
    full_out, wp = out_ref, w
    if sp and kind != "column":
        full_out, wp = (tp.shard_tensor(u, 1, tr, tw) for u in (out_ref, w))
    elif kind == "column" and not kw.get("gather_output", False):
        full_out, wp = (tp.shard_tensor(u, -1, tr, tw) for u in (out_ref, w))
    with tp.comm_log() as bwd:
        (out_par * wp).sum().backward()
    with tp.comm_log() as sync:
        tp.sync_tensor_parallel_grads(par)
    diffs = {"output": (out_par - full_out).abs().max().item()}
    if x.is_floating_point():
        diffs["input"] = (xp.grad - _shard_in(kind, xr.grad, group, sp, kw)).abs().max().item()
    ref_grads = tp.shard_state_dict(par, {n: p.grad for n, p in ref.named_parameters()})
    for name, p in par.named_parameters():
        diffs[name] = (p.grad - ref_grads[name]).abs().max().item()
    if count:
        return diffs, {"forward": fwd.summary(), "backward": bwd.summary(), "sync": sync.summary(),
                       "sent": fwd.sent_bytes() + bwd.sent_bytes()}
    if kw.get("dropout") or kw.get("attn_dropout"):
        with torch.no_grad():
            par.eval()
            dropped = (par(xp) - out_par).abs().max().item()
        return diffs, dropped
    return diffs


def llama_cases(kind: str, sp: bool, **kw) -> dict:
    """``transparency`` of a Llama block for every t in (1, 2, 4) and kv heads 1, 2, 4, 8 (below, equal
    to and above t): {(t, kv): diffs}."""
    return {(t, kv): transparency(kind, t, sp, kv_heads=kv, **kw) for t in (1, 2, 4) for kv in (1, 2, 4, 8)}


def for_each_t(fn, ts: tuple[int, ...], *args, **kw) -> dict:
    """``fn(*args, t=t, **kw)`` for each t in one c4 run (saves a round trip per case)."""
    return {t: fn(*args, t=t, **kw) for t in ts}


def f_backward_identity(t: int):
    """The deliberate bug of §8 pitfall 6: f's backward written as identity."""
    cls = collectives._CopyToTensorParallelRegion
    original = cls.backward
    cls.backward = staticmethod(lambda ctx, grad: (grad, None))
    try:
        return transparency("layer", t)
    finally:
        cls.backward = original


def cross_entropy(t: int, reduction: str = "mean", vocab: int = VOCAB, padded: int = VOCAB):
    """Vocabulary-parallel cross entropy of ``padded`` logits (the last ``padded - vocab`` ids padding)
    against ``F.cross_entropy`` of the ``vocab`` real ones on one process."""
    group = tp_group(t)
    tr, tw = tp._comm.group_rank(group), tp._comm.group_size(group)
    torch.manual_seed(4)
    logits = torch.randn(B, S, padded, dtype=torch.float64) * 3
    target = torch.randint(0, vocab, (B, S))
    target[0, :3] = -100
    full = logits[..., :vocab].clone().requires_grad_(True)
    ref = F.cross_entropy(full.view(-1, vocab), target.view(-1), ignore_index=-100, reduction=reduction)
    shard = tp.shard_tensor(logits, -1, tr, tw).requires_grad_(True)
    with tp.comm_log() as log:
        loss = tp.vocab_parallel_cross_entropy(shard, target, group, ignore_index=-100, reduction=reduction,
                                               vocab_size=vocab if vocab < padded else None)
    g = torch.randn(loss.shape, dtype=torch.float64) if reduction == "none" else torch.tensor(1.7, dtype=torch.float64)
    (loss * g).sum().backward()
    (ref.view(loss.shape) * g).sum().backward()
    ref_grad = torch.cat([full.grad, torch.zeros(B, S, padded - vocab, dtype=torch.float64)], -1)
    ids = torch.arange(tr * padded // tw, (tr + 1) * padded // tw)
    return {"loss": (loss - ref.view(loss.shape)).abs().max().item(),
            "grad": (shard.grad - tp.shard_tensor(ref_grad, -1, tr, tw)).abs().max().item(),
            "ignored_grad": shard.grad[0, :3].abs().max().item(),
            "padded_grad": shard.grad[..., ids >= vocab].abs().max().item() if (ids >= vocab).any() else 0.0,
            "padded_ids": int((ids >= vocab).sum()),
            "comm": log.summary()}


def meta_and_gather(t: int, sp: bool, kind: str = "layer", **kw):
    """Build on the meta device, materialise, load shards; gathering them back gives the full state dict."""
    group = tp_group(t)
    ref = build(kind, None, False, **kw)
    with torch.device("meta"):
        par = build(kind, group, sp, **kw)
    par.to_empty(device="cpu")
    tp.load_full_state_dict(par, ref.state_dict())
    full = tp.gather_full_state_dict(par)
    layouts = {n: tp.param_layout(p) for n, p in par.named_parameters()}
    specs = {n: (lay.dim, lay.blocks, lay.replicas, lay.sequence_parallel) for n, lay in layouts.items()}
    return max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items()), specs


def expect_value_error(case: str):
    """Run a bad-input case; return the ValueError message this rank raised (or None)."""
    g4 = tp_group(4)
    try:
        if case == "heads":
            tp.ParallelAttention(24, 6, group=g4)
        elif case == "hidden":
            tp.ParallelMLP(8, ffn_hidden=30, group=g4)
        elif case == "vocab":
            tp.VocabParallelEmbedding(50257, 8, group=g4)
        elif case == "not_member":
            if "01" not in _GROUPS:
                _GROUPS["01"] = dist.new_group([0, 1])  # every rank calls new_group; 2 and 3 are outside
            tp.ColumnParallelLinear(8, 8, group=_GROUPS["01"])
            return "member"
        elif case == "shapes":
            row = tp.RowParallelLinear(8, 4, group=g4, dtype=torch.float64)
            row(torch.randn(2 + dist.get_rank() % 2, 3, 2, dtype=torch.float64))
        elif case == "one_bad_id":  # only rank 1's input is bad: the others must not wait for it
            emb = tp.VocabParallelEmbedding(VOCAB, 4, group=g4)
            emb(torch.tensor([[0, 99 if dist.get_rank() == 1 else 1]]))
        elif case == "target":
            tp.vocab_parallel_cross_entropy(torch.randn(4, 8), torch.tensor([0, 1, 99, 2]), g4)
    except ValueError as err:
        return str(err)
    return None


# --- tests (run in the parent) ---------------------------------------------------------------
TOL = 1e-12


def _assert_all_close(results, tol=TOL, cases=1):
    """``results``: per rank, a diffs dict or {case: diffs dict} with ``cases`` entries; every diffs dict
    holds the output, the input gradient (if the input is not ids) and at least one weight gradient."""
    assert len(results) == 4
    for rank, res in enumerate(results):
        per_case = res if "output" not in res else {None: res}
        assert len(per_case) == cases, (rank, list(per_case))
        for case, diffs in per_case.items():
            assert "output" in diffs and any(k.endswith("weight") for k in diffs), (rank, case, list(diffs))
            bad = {k: v for k, v in diffs.items() if v > tol}
            assert not bad, f"rank {rank}, case {case}: {bad}"


@pytest.mark.parametrize("kind,kw", [
    ("column", {}), ("column", {"gather_output": True}), ("row", {}), ("row", {"input_is_parallel": False}),
    ("embedding", {}), ("mlp", {}), ("attention", {}), ("layer", {}),
])
def test_output_and_every_gradient_match_one_process(c4, kind, kw):
    _assert_all_close(c4.run(for_each_t, transparency, (1, 2, 4), kind, **kw), cases=3)


@pytest.mark.parametrize("kind", ["column", "row", "embedding", "mlp", "attention", "layer"])
def test_sequence_parallel_matches_one_process(c4, kind):
    results = c4.run(for_each_t, transparency, (2, 4), kind, sp=True)
    _assert_all_close(results, cases=2)
    if kind == "layer":  # LayerNorm γ/β and row biases were compared after the SP gradient sum
        assert {"ln1.weight", "ln2.bias", "attn.proj.bias", "mlp.fc2.bias", "input"} <= set(results[0][4])


@pytest.mark.parametrize("kind", ["llama_attention", "llama_layer"])
@pytest.mark.parametrize("sp", [False, True])
def test_llama_blocks_match_one_process_for_kv_heads_below_equal_and_above_t(c4, kind, sp):
    results = c4.run(llama_cases, kind, sp)
    _assert_all_close(results, cases=12)
    names = set(results[0][(4, 1)])  # t = 4, one kv head replicated on 4 ranks: its gradient summed over them
    assert "kv.weight" in names or {"attn.kv.weight", "ln1.weight", "mlp.fc1.weight", "input"} <= names


def test_selective_recomputation_under_tensor_parallelism(c4):
    _assert_all_close(c4.run(llama_cases, "llama_layer", True, recompute_core=True), cases=12)


@pytest.mark.parametrize("sp", [False, True])
def test_dropout_masks_are_the_single_process_ones(c4, sp):
    results = c4.run(transparency, "layer", 4, sp=sp, dropout=0.2, attn_dropout=0.1)
    _assert_all_close([diffs for diffs, _ in results])
    assert all(dropped > 1e-3 for _, dropped in results)  # the masks did drop something


def test_f_backward_written_as_identity_is_caught(c4):
    for diffs in c4.run(f_backward_identity, 2):
        assert diffs["output"] < TOL  # the forward is still right ...
        assert diffs["input"] > 1e-3 and diffs["ln1.weight"] > 1e-3  # ... the gradients are not
        assert diffs["mlp.fc1.weight"] < TOL  # weights after f still see the right gradient


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocab_parallel_cross_entropy_equals_F_cross_entropy(c4, reduction):
    for per_t in c4.run(for_each_t, cross_entropy, (1, 2, 4), reduction=reduction):
        assert len(per_t) == 3
        for t, res in per_t.items():
            assert res["loss"] < TOL and res["grad"] < TOL, (t, res)
            assert res["ignored_grad"] == 0.0
            if t > 1:  # max, Σexp and the target logit: three all-reduces of one scalar per token
                assert res["comm"][("all_reduce", "forward")] == (3, 3 * B * S)


def test_padded_vocabulary_gets_no_probability_and_the_unpadded_loss(c4):
    # 50 real ids padded to 64: at t = 4 rank 3 holds ids 48..63, 14 of them padding
    results = c4.run(for_each_t, cross_entropy, (1, 2, 4), vocab=50, padded=64)
    for rank, per_t in enumerate(results):
        for t, res in per_t.items():
            assert res["loss"] < TOL and res["grad"] < TOL, (t, res)
            assert res["padded_grad"] == 0.0  # softmax of a padded id is exactly 0
        assert per_t[4]["padded_ids"] == (14 if rank % 4 == 3 else 0)


@pytest.mark.parametrize("t", [2, 4])
def test_communication_counts_per_layer(c4, t):
    bsh = B * S * H
    (_, plain), = c4.run(transparency, "layer", t, count=True)[:1]
    assert plain["forward"] == {("all_reduce", "forward"): (2, 2 * bsh), ("shape_check", "forward"): (2, 2 * 11 * t)}
    assert plain["backward"] == {("all_reduce", "backward"): (2, 2 * bsh)}
    assert plain["sync"] == {}  # nothing partial without SP or replicated kv heads
    (_, sp), = c4.run(transparency, "layer", t, sp=True, count=True)[:1]
    assert sp["forward"][("all_gather", "forward")] == (2, 2 * bsh)
    assert sp["forward"][("reduce_scatter", "forward")] == (2, 2 * bsh)
    assert sp["backward"] == {("reduce_scatter", "backward"): (2, 2 * bsh), ("all_gather", "backward"): (2, 2 * bsh)}
    assert sp["sent"] == pytest.approx(plain["sent"])  # all-reduce = reduce-scatter + all-gather
    assert plain["sent"] == pytest.approx(4 * 2 * (t - 1) / t * bsh * 8)  # §5.6: 4 all-reduces of b·s·h
    # grouped-query attention: q and kv share one f, so the same 2 + 2 all-reduces; a kv head on t
    # ranks adds one all-reduce after backward, of the whole [Wk; Wv] (2·d·h): each rank's slot of it
    (_, llama), = c4.run(transparency, "llama_layer", t, kv_heads=1, count=True)[:1]
    lbsh = B * S * LLAMA_H
    assert llama["forward"][("all_reduce", "forward")] == (2, 2 * lbsh)
    assert llama["backward"] == {("all_reduce", "backward"): (2, 2 * lbsh)}
    assert llama["sync"] == {("all_reduce", "backward"): (1, 2 * (LLAMA_H // LLAMA_HEADS) * LLAMA_H)}


@pytest.mark.parametrize("t,sp", [(2, False), (4, True)])
def test_meta_build_load_and_gather_round_trip(c4, t, sp):
    for err, specs in c4.run(meta_and_gather, t, sp):
        assert err == 0.0
        assert specs["attn.qkv.weight"] == (0, 3, 1, False)
        assert specs["mlp.fc2.weight"] == (1, 1, 1, False)
        assert specs["mlp.fc2.bias"] == (None, 1, 1, sp)
        assert specs["ln1.weight"] == (None, 1, 1, sp)
    for err, specs in c4.run(meta_and_gather, t, sp, "llama_layer", kv_heads=1):
        assert err == 0.0
        assert specs["attn.kv.weight"] == (0, 2, t, False)  # [Wk; Wv] of the one kv head, on every rank
        assert specs["attn.q.weight"] == (0, 1, 1, False) and specs["mlp.fc1.weight"] == (0, 2, 1, False)


@pytest.mark.parametrize("case,every_rank,match", [
    ("heads", True, r"heads \(6\) must be divisible by the tensor-parallel size t \(4\)"),
    ("hidden", True, r"ffn_hidden \(30\) must be divisible by the tensor-parallel size t \(4\)"),
    ("vocab", True, r"num_embeddings \(50257\) .* pad_vocab_size\(50257, 4\) = 50260"),
    ("shapes", True, r"must have the same shape .* rank 0: \(2, 3, 4\).* rank 1: \(3, 3, 4\)"),
    ("target", True, r"target must be in \[0, 32\) or -100, got 99"),
    ("one_bad_id", True, r"ids must be in \[0, 32\), got 99|ids is invalid on tensor-parallel rank\(s\) \[1\]"),
    ("not_member", False, r"global rank [23]\) is not a member of group ranks \[0, 1\]"),
])
def test_bad_input_is_a_clear_error_on_every_rank(c4, case, every_rank, match):
    messages = c4.run(expect_value_error, case)
    ranks = range(4) if every_rank else (2, 3)
    for r in ranks:
        assert messages[r] is not None and re.search(match, messages[r]), (r, messages[r])
    if not every_rank:
        assert messages[0] == messages[1] == "member"
    if case == "one_bad_id":  # the bad rank names its value, the others name the bad rank
        assert "got 99" in messages[1] and all("rank(s) [1]" in messages[r] for r in (0, 2, 3))
