"""``--compile`` and the chunked head and loss: the same training as eager, in float64.

Compiled blocks (``modelpar.training.compile``) trained against the same run in eager mode on real gloo
processes, for every dimension the issue names: (1,1,1), a pipeline under 1F1B and ZB-H1 (the split
backward re-runs a compiled block's backward), t = 2 with sequence parallelism, cp = 2, ZeRO-3 (gathers per
block), experts over ep = 2, recomputation; and whole compiled stages (``--compile-scope stage``) for every
dimension they run with. The matrix compiles with ``aot_eager`` (dynamo's graphs and AOT
autograd, no code generation: seconds, not minutes, on 2 cores); one run compiles with inductor. One 2-rank
cluster for the module.
"""

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from modelpar.model import LMLoss, ModelConfig, build_stage
from modelpar.tensor_parallel import vocab_parallel_cross_entropy
from modelpar.tensor_parallel.head_loss import chunk_tokens, chunked_head_cross_entropy
from modelpar.training import TrainConfig, train
from modelpar.training.compile import compile_blocks, compile_stages, gather_units

LLAMA = ModelConfig(arch="llama", hidden=32, heads=4, kv_heads=2, layers=4, seq_len=16)
BASE = TrainConfig(model=LLAMA, steps=3, batch_size=8, microbatches=2, precision="fp64", warmup=1, lr=1e-2, clip=0.5,
                   eval_every=0, eval_batches=1, tp=1, pp=1, dp=1)
TOL = 1e-12


def _train(cfg):
    torch.set_num_threads(1)
    r = train(cfg)
    return r.losses, r.grad_norms, r.val[-1][1], r.compile_seconds


_EAGER: dict[str, list] = {}


def _eager(cluster, cfg):
    """The eager run of ``cfg``, trained once per module: the block and the stage tests compare against it."""
    if repr(cfg) not in _EAGER:
        _EAGER[repr(cfg)] = cluster.run(_train, cfg)
    return _EAGER[repr(cfg)]


# dp2's 16 rows make 4 per microbatch on a rank, as in the pipeline cases (8 rows over 2 microbatches): the same
# shapes, so a rank compiles the block once for dp2, 1F1B and ZB-H1 (dynamo's cache is on the block's code, guarded
# on the tensors' metadata; recompute's run, after them, fails those guards and compiles its own, about 1 s); each
# case still trains compiled against eager.
CASES = {
    "dp2": dict(dp=2, batch_size=16),
    "1f1b": dict(pp=2, schedule="1f1b"),
    "zb-h1": dict(pp=2, schedule="zb-h1"),
    "tp2-sp": dict(tp=2, sequence_parallel=True, loss_chunk_mb=0.01),  # and the loss over several chunks
    "cp2": dict(cp=2),
    "zero3": dict(dp=2, zero=3, bucket_mb=0.04),
    "moe-ep2": dict(dp=2, ep=2, model=dataclasses.replace(LLAMA, experts=2, top_k=1)),
    "recompute": dict(pp=2, recompute="full"),
}


@pytest.mark.parametrize("case", CASES)
def test_compiled_blocks_train_as_eager(c2, case):
    cfg = dataclasses.replace(BASE, **CASES[case])
    eager = _eager(c2, cfg)
    compiled = c2.run(_train, dataclasses.replace(cfg, compile=True, compile_backend="aot_eager"))
    for (losses, norms, val, _), (c_losses, c_norms, c_val, seconds) in zip(eager, compiled):
        assert c_losses == pytest.approx(losses, abs=TOL, rel=0)
        assert c_norms == pytest.approx(norms, abs=TOL, rel=0)
        assert c_val == pytest.approx(val, abs=TOL, rel=0)
        assert seconds is not None and seconds >= 0.0
    assert eager[0][3] is None  # not compiled: no compile time reported


def _context_frames_compiled(cfg):
    """Train ``cfg`` from an empty dynamo cache; how many compiled entries dynamo then holds for the code of
    context parallelism (``tensor_parallel/context_parallel.py``: its functions and its autograd Functions)."""
    import inspect

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from modelpar.tensor_parallel import context_parallel

    torch._dynamo.reset()
    _train(cfg)
    functions = [f for f in vars(context_parallel).values() if inspect.isfunction(f)]
    functions += [getattr(c, n) for c in vars(context_parallel).values()
                  if isinstance(c, type) and issubclass(c, torch.autograd.Function) for n in ("forward", "backward")]
    return sum(len(_debug_get_cache_entry_list(f.__code__)) for f in functions)


def test_context_parallel_attention_runs_eagerly_inside_a_compiled_block(c2):
    """cp's attention is marked eager (``ContextParallel.attend``): dynamo compiled the ring's frames apart, its
    attention again for each ring step's chunk ids (9 entries a rank at cp = 2 before it was marked)."""
    cfg = dataclasses.replace(BASE, **CASES["cp2"], compile=True, compile_backend="aot_eager")
    assert c2.run(_context_frames_compiled, cfg) == [0, 0]


# data parallel, a pipeline with one and with two stages per rank, and collectives inside the graph (t = 2, SP)
STAGE_CASES = {name: CASES[name] for name in ("dp2", "1f1b", "tp2-sp")} | {
    "interleaved": dict(pp=2, schedule="interleaved", chunks=2, microbatches=4)}


@pytest.mark.parametrize("case", STAGE_CASES)
def test_compiled_stages_train_as_eager(c2, case):
    """``--compile-scope stage``: each stage's forward one graph (collectives inside break it, as in eager)."""
    cfg = dataclasses.replace(BASE, **STAGE_CASES[case])
    eager = _eager(c2, cfg)
    compiled = c2.run(_train, dataclasses.replace(cfg, compile=True, compile_scope="stage", compile_backend="aot_eager"))
    for (losses, norms, val, _), (c_losses, c_norms, c_val, seconds) in zip(eager, compiled):
        assert c_losses == pytest.approx(losses, abs=TOL, rel=0)
        assert c_norms == pytest.approx(norms, abs=TOL, rel=0)
        assert c_val == pytest.approx(val, abs=TOL, rel=0)
        assert seconds is not None and seconds >= 0.0


def _checks_traced(cfg):
    """Train ``cfg`` from an empty dynamo cache; the graphs dynamo then holds for the cross-rank shape check's code
    (``check_same_shape``, which reads the host)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from modelpar.tensor_parallel._comm import check_same_shape

    torch._dynamo.reset()
    _train(cfg)
    return len(_debug_get_cache_entry_list(check_same_shape.__code__))


def test_a_whole_stage_at_t2_is_compiled_once_its_checks_are_off(c2):
    """At t = 2 the first step's cross-rank shape checks read the host: the stage runs eagerly until they are off,
    so no graph traces them (compiled from its second call, dynamo traced the check 4 times on a rank; with
    t = 2 and 4 steps of ``modelpar train``, 118 graph breaks and 78 recompiles before, 82 and 56 after)."""
    cfg = dataclasses.replace(BASE, tp=2, compile=True, compile_scope="stage", compile_backend="aot_eager")
    assert c2.run(_checks_traced, cfg) == [0, 0]


def test_a_whole_stage_is_one_graph_after_its_first_call():
    """The stage's forward, embedding to final norm, is one graph: its first call runs eagerly (the token ids read
    on the host, once), the second compiles it whole, later calls run it without a break or a new graph."""
    torch._dynamo.reset()
    model = build_stage(LLAMA, seed=0, dtype=torch.float64, head_in_loss=True)
    compile_stages({0: model}, "aot_eager").stop()
    x = torch.randint(0, LLAMA.vocab_size, (2, LLAMA.seq_len))
    loss = LMLoss(LLAMA.vocab_size, head=model.head)
    counts = []
    for _ in range(4):
        counters.clear()
        loss(model(x), x).backward()
        counts.append((counters["stats"]["unique_graphs"], len(counters["graph_break"])))
    assert counts == [(0, 0), (1, 0), (0, 0), (0, 0)]


@pytest.mark.parametrize("changes, clash", [
    (dict(dp=2, zero=3), "zero 3"), (dict(pp=2, schedule="zb-h1"), "split-backward"),
    (dict(recompute="selective"), "recompute selective"), (dict(offload_activations="all"), "offload_activations all"),
    (dict(compile_scope="graph"), "compile_scope must be one of block, stage, got 'graph'")])
def test_what_a_whole_stage_graph_cannot_hold_is_refused_in_one_line(changes, clash):
    cfg = dataclasses.replace(BASE, compile=True, compile_scope="stage")
    with pytest.raises(ValueError, match=clash) as err:
        dataclasses.replace(cfg, **changes).check()
    assert "\n" not in str(err.value)


def test_the_inductor_backend_compiles_the_blocks_and_trains_as_eager(c1):
    """(1, 1, 1) on one process with the default backend: generated kernels, the same losses (float64)."""
    eager = c1.run(_train, BASE)[0]
    compiled = c1.run(_train, dataclasses.replace(BASE, compile=True))[0]
    assert compiled[0] == pytest.approx(eager[0], abs=1e-10, rel=0)
    assert compiled[3] > 0.0  # the compile time the summary reports


def test_every_block_shares_one_graph():
    """Four blocks, one compilation: the guards are on the blocks' type and tensor metadata, not their identity."""
    torch._dynamo.reset()
    counters.clear()
    model = build_stage(LLAMA, seed=0, dtype=torch.float64, head_in_loss=True)
    compile_blocks({0: model}, "aot_eager").stop()
    x = torch.randint(0, LLAMA.vocab_size, (2, LLAMA.seq_len))
    LMLoss(LLAMA.vocab_size, head=model.head)(model(x), x).backward()
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


def test_zero3_gathers_around_whole_blocks_when_compiled():
    model = build_stage(LLAMA, seed=0, head_in_loss=True)
    units = gather_units(model, compiled=True)
    blocks = list(model.layers.values())
    assert [u for u in units if u in blocks] == blocks  # each block whole, in order
    inside = {id(m) for b in blocks for m in b.modules()} - {id(b) for b in blocks}
    assert not inside & {id(u) for u in units}  # nothing inside a block: its hooks would run inside the graph
    assert gather_units(model, compiled=False)[0] is model.embed.word  # eager: every module with parameters


# --- the chunked head and loss ------------------------------------------------------------------------------
class _Largest(TorchDispatchMode):
    """The most elements any operation produced while active."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize("vocab", [256, 200])  # 200: padded to 256, the padded ids masked
def test_the_chunked_loss_is_the_whole_loss(vocab):
    torch.manual_seed(0)
    x = torch.randn(3, 16, 32, dtype=torch.float64, requires_grad=True)
    w = torch.randn(256, 32, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, vocab, (3, 16))
    target[0, :5] = -100  # ignored
    whole = vocab_parallel_cross_entropy(x @ w.t(), target, vocab_size=vocab)
    gx, gw = torch.autograd.grad(whole, [x, w])
    with _Largest() as seen:
        chunked = chunked_head_cross_entropy(x, w, target, vocab_size=vocab, chunk=7)
        cx, cw = torch.autograd.grad(chunked, [x, w])
    assert chunked.item() == pytest.approx(whole.item(), abs=1e-14, rel=0)
    assert torch.allclose(cx, gx, rtol=0, atol=1e-15) and torch.allclose(cw, gw, rtol=0, atol=1e-15)
    assert seen.most == max(7 * 256, 256 * 32)  # a chunk's logits at most (or the weight's gradient), never 48 × 256


def test_chunk_tokens_fits_the_budget():
    assert chunk_tokens(2**20, 256, torch.float32) == 1024  # 1 MiB of fp32 logits over 256 ids
    assert chunk_tokens(2**20, 256, torch.bfloat16) == 1024  # 16-bit logits are upcast: still 4 bytes
    assert chunk_tokens(2**20, 256, torch.float64) == 512
    assert chunk_tokens(1, 256, torch.float32) == 1  # never 0
    cfg = dataclasses.replace(BASE, loss_chunk_mb=1.0, tp=2)
    assert cfg.loss_chunk == 2**20 // (8 * 256 // 2)  # V/t = 128 float64 logits per token on a rank
    assert dataclasses.replace(BASE, loss_chunk_mb=0).loss_chunk == 0


def test_a_bad_compile_backend_is_one_line():
    with pytest.raises(ValueError, match=r"compile_backend must be one of .*inductor.*got 'nope'"):
        dataclasses.replace(BASE, compile=True, compile_backend="nope").check()


# --- on a GPU (skipped elsewhere): the same paths with CUDA kernels ------------------------------------------
@pytest.mark.cuda
def test_on_cuda_compiled_blocks_and_the_chunked_loss_match_eager():
    """fp32 on the GPU, inductor's kernels against eager, the loss in 3 chunks against the whole logits."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = dataclasses.replace(LLAMA, hidden=128, heads=8, kv_heads=2, seq_len=64)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), device="cuda")
    grads = []
    for compiled, chunk in ((False, 0), (True, 100)):
        model = build_stage(cfg, seed=0, device="cuda", head_in_loss=bool(chunk))
        if compiled:
            compile_blocks({0: model}, "inductor").stop()
        loss = LMLoss(cfg.vocab_size, head=model.head if chunk else None, chunk=chunk)(model(x), x)
        loss.backward()
        grads.append((loss.item(), [p.grad for p in model.parameters()]))
    (eager, g0), (comp, g1) = grads
    assert comp == pytest.approx(eager, rel=1e-5)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-5)
