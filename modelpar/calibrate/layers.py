"""The trainer's own work, measured whole: a transformer layer, the stage ends, the runtime, the optimizer step.

The kernel measurements of ``compute.py`` (GEMMs at their shapes, attention, element-wise bytes) miss
what a layer costs beyond its kernels: the many small ops of a small layer, their dispatch through
autograd, the hand-over between threads. Here the model's own modules run at the process's thread
count (``docs/calibrate.md``, "Where a one-rank step goes"):

- ``measure_layers``: ``modelpar.tensor_parallel.ParallelTransformerLayer`` (GPT-2 style: LayerNorm,
  GeLU, biases) over a grid of (hidden, tokens) at ``LAYER_HEADS`` heads and ``LAYER_SEQ`` tokens per
  sequence: the forward, the backward, and both under full recomputation (``recompute_sequential``).
- ``measure_ends``: the first stage's embedding (tokens and learned positions) and the last stage's
  final norm, output layer and cross entropy (``modelpar.model.LMLoss``), forward and backward.
- ``measure_runtime``: a ``PipelineRunner`` step of a tiny model at 1 and 8 microbatches beside the
  same microbatches computed directly: the runtime's cost per action and per step.
- ``measure_optimizer``: the trainer's step end (the batch, the gradient norm and clipping, the stop agreement,
  AdamW, the zeroing: ``trainer_step_end``, a short ``modelpar train`` on every rank of the process count) over six
  model sizes; on a GPU measured in this process, AdamW as the trainer builds it, the norm and the zeroing of a flat
  gradient buffer alone. ``fit_optimizer`` fits them as ``latency + tensors·per_tensor + state bytes / bandwidth``.

Times are means of at least ``REPS`` runs (runs over twice their median, a rare pause, left out:
``compute.steady_mean``), each with the caches flushed first, a forward and its backward
timed within the same run (``timed_pair``, ``timed``): a step's time is
the sum of its parts, so their means add up to its mean (a median or the fastest run leaves out the pauses a
shared machine gives every process, which a step of many parts always meets), and in a step every layer
finds the caches holding the other layers' work. A
layer is timed inside a stack of ``STACK`` layers with their own weights, as a stage runs them (one alone,
its weights and input cache-hot, ran up to a third faster than its share of a stage); the cost model
interpolates between grid points (``costmodel.local_compute``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from modelpar.calibrate.compute import DTYPES, repeated, steady_mean, sync
from modelpar.calibrate.compute import timed as _timed

__all__ = [
    "END_VOCAB",
    "LAYER_HEADS",
    "LAYER_SEQ",
    "TP_MEASURED",
    "Grid",
    "compiled_grid",
    "layer_grid",
    "measure_blockwise",
    "measure_compiled_layers",
    "measure_ends",
    "measure_layers",
    "measure_optimizer",
    "measure_runtime",
    "measure_tp_layers",
    "only_grid",
    "timed_pair",
]

LAYER_HEADS = 4  # heads of the measured layers (the residual beyond the kernels hardly depends on them)
LAYER_SEQ = 64  # tokens per sequence of the measured layers (CPU); a micro-batch is tokens / seq sequences
END_VOCAB = 256  # the padded vocabulary of the measured output layer
REPS = 5  # at least this many runs; their steady mean is kept (the fastest ran 10-30% below the trainer's median)
STACK = 4  # layers of the measured stack: a layer's figures are the stack's / STACK


QUICK_S = 0.01  # a budget below this (tests) measures a 2 × 2 grid, one run each


def timed(fn: Any, device: torch.device, budget_s: float) -> float:
    """The steady mean (``compute.steady_mean``) of at least ``REPS`` runs (one below ``QUICK_S``) after a warm-up,
    the caches flushed before each (``compute.timed``)."""
    return _timed(fn, device, budget_s, min_reps=REPS if budget_s >= QUICK_S else 1, statistic=steady_mean,
                  cold=True)


def timed_pair(forward: Any, backward: Any, device: torch.device, budget_s: float, cold: bool = True,
               min_reps: int = REPS) -> tuple[float, float]:
    """Steady mean seconds of ``forward()`` and of ``backward(out)`` on its output, each timed within the same run (as a
    step runs an F and later its B; two means of separate runs subtracted would add both runs' noise to the
    backward): one warm-up, then at least ``min_reps`` runs (one below ``QUICK_S``) within ``budget_s``, the caches
    flushed before each where ``cold`` (``compute.repeated``)."""
    def once() -> tuple[float, float]:
        t0 = time.perf_counter()
        out = forward()
        sync(device)
        t1 = time.perf_counter()
        backward(out)
        sync(device)
        return t1 - t0, time.perf_counter() - t1

    backward(forward())
    sync(device)
    runs = repeated(once, device, budget_s, min_reps=min_reps if budget_s >= QUICK_S else 1, cold=cold)
    return steady_mean([r[0] for r in runs]), steady_mean([r[1] for r in runs])


Grid = tuple[tuple[int, ...], tuple[int, ...], int]  # (hiddens, tokens per micro-batch, tokens per sequence)
_ONLY: list[Grid] = []  # ``only_grid``'s: one run's own shapes (the short calibration of ``calibrate.cache``)


@contextlib.contextmanager
def only_grid(grid: Grid | None) -> Iterator[None]:
    """Measure the whole-work tables at ``grid`` alone (None: ``layer_grid``'s own) while inside."""
    _ONLY[:] = [grid] if grid is not None else []
    try:
        yield
    finally:
        _ONLY.clear()


def layer_grid(device: str, budget_s: float = QUICK_S) -> Grid:
    """(hiddens, tokens per micro-batch, tokens per sequence) of the measured layers; larger on a GPU, 2 × 2
    below ``QUICK_S``; inside ``only_grid`` its grid."""
    if _ONLY:
        return _ONLY[0]
    if budget_s < QUICK_S:
        return (64, 128), (64, 128), LAYER_SEQ
    if device == "cpu":
        return (64, 128, 256), (64, 128, 256, 512), LAYER_SEQ
    return (1024, 2048, 4096), (2048, 8192), 1024


def _layer_times(stack: torch.nn.Sequential, x: torch.Tensor, device: torch.device, budget_s: float) -> list[float]:
    """Forward, backward, and the same under full recomputation (the stack's input kept, as a stage's), per layer
    of ``stack`` on ``x``."""
    from modelpar.recompute import recompute_sequential

    grad = torch.ones_like(x)

    def backward(out: torch.Tensor) -> None:
        out.backward(grad)

    f, b = timed_pair(lambda: stack(x), backward, device, budget_s)
    fk, bk = timed_pair(lambda: recompute_sequential(list(stack), x, "full"), backward, device, budget_s)
    return [t / len(stack) for t in (f, b, fk, bk)]


def measure_layers(dtype: str, device: torch.device, budget_s: float = 0.05) -> list[list[float]]:
    """[[hidden, heads, seq, tokens, forward_s, backward_s, forward_recomputed_s, backward_recomputed_s], ...] of a
    ``ParallelTransformerLayer`` (ffn 4h) over ``layer_grid``, per layer of a stack of ``STACK``; the
    backward's input needs a gradient, as every stage's but the first does."""
    from modelpar.tensor_parallel import ParallelTransformerLayer

    hiddens, token_counts, seq = layer_grid(device.type, budget_s)
    out = []
    for h in hiddens:
        stack = torch.nn.Sequential(*(ParallelTransformerLayer(h, LAYER_HEADS, 4 * h, device=device,
                                                               dtype=DTYPES[dtype]) for _ in range(STACK)))
        for tokens in token_counts:
            x = torch.randn(tokens // seq, seq, h, device=device, dtype=DTYPES[dtype], requires_grad=True)
            out.append([h, LAYER_HEADS, seq, tokens, *_layer_times(stack, x, device, budget_s)])
    return out


def compiled_grid(device: str, budget_s: float = QUICK_S) -> Grid:
    """The corners of ``layer_grid`` (its smallest and largest hidden × tokens; inside ``only_grid`` its one cell):
    each shape is one compilation of several seconds on a CPU, and the cost model interpolates between corners."""
    hiddens, token_counts, seq = layer_grid(device, budget_s)
    return tuple(sorted({hiddens[0], hiddens[-1]})), tuple(sorted({token_counts[0], token_counts[-1]})), seq


def measure_compiled_layers(dtype: str, device: torch.device, budget_s: float = 0.05,
                            backend: str = "inductor") -> list[list[float]]:
    """``measure_layers``' rows for the layer as ``--compile`` runs it: each layer's forward compiled
    (``training.compile.compile_block``, one static graph per shape; the stack's layers share it) at
    ``compiled_grid``'s shapes, the compilation in the warm-up, not the times. Full recomputation is not timed
    again: its forward is the forward, its backward the forward and the backward."""
    from modelpar.tensor_parallel import ParallelTransformerLayer
    from modelpar.training.compile import compile_block

    hiddens, token_counts, seq = compiled_grid(device.type, budget_s)
    out = []
    for h in hiddens:
        stack = torch.nn.Sequential(*(compile_block(ParallelTransformerLayer(h, LAYER_HEADS, 4 * h, device=device,
                                                                             dtype=DTYPES[dtype]), backend, False)
                                      for _ in range(STACK)))
        for tokens in token_counts:
            x = torch.randn(tokens // seq, seq, h, device=device, dtype=DTYPES[dtype], requires_grad=True)
            f, b = (t / STACK for t in timed_pair(partial(stack, x), partial(_backward_with, torch.ones_like(x)),
                                                   device, budget_s))
            out.append([h, LAYER_HEADS, seq, tokens, f, b, f, f + b])
    return out


TP_MEASURED = 2  # the tensor-parallel degree measured whole: every pair of ranks (0, 1), (2, 3), … at once
TP_REPS = 20  # runs per shape: a run of the stack is 16 collectives, each now and then several times its usual
# length (one layer's forward 2.3-9.9 ms over 14 runs on a 2-core VM), so 5 runs' mean was 15% off


def measure_tp_layers(dtype: str, device: torch.device, budget_s: float = 0.05) -> list[list[float]]:
    """[[t, hidden, heads, seq, tokens, forward_s, backward_s, forward_recomputed_s, backward_recomputed_s], ...]:
    the layer of ``measure_layers`` sharded over each pair of ranks (a tensor-parallel group of ``TP_MEASURED``;
    every pair at once), its all-reduces inside the times, at the grid's hidden sizes and its smallest, middle
    and largest token counts; at least ``TP_REPS`` runs each, the caches not flushed (a flush's length differs
    between the ranks, and a forward's first collective would wait it out), the cross-rank shape check off as
    the trainer runs after its first step (it adds an all-gather to every forward collective). A t = 2 step
    calls its all-reduces in lockstep, one after each short identical computation: priced one by one from a
    collective measured after a barrier and a 1 ms GEMM, a 64 KB one came to 1.65-1.9 ms where the step paid
    1.22-1.65 (a 2-core VM). Full recomputation is not timed again: its forward is the forward, its backward
    the forward and the backward. [] on a rank without a partner (an odd world), which computes nothing."""
    from modelpar.calibrate.busy import pair_groups
    from modelpar.tensor_parallel import ParallelTransformerLayer, set_shape_checks

    pairs, mine = pair_groups()
    if mine is None:
        return []
    hiddens, token_counts, seq = layer_grid(device.type, budget_s)
    tokens_measured = sorted({token_counts[0], token_counts[len(token_counts) // 2], token_counts[-1]})
    out = []
    for h in hiddens:
        stack = torch.nn.Sequential(*(ParallelTransformerLayer(h, LAYER_HEADS, 4 * h, device=device, dtype=DTYPES[dtype],
                                                               group=pairs[mine]) for _ in range(STACK)))
        set_shape_checks(stack, False)
        for tokens in tokens_measured:
            x = torch.randn(tokens // seq, seq, h, device=device, dtype=DTYPES[dtype], requires_grad=True)
            f, b = (t / STACK for t in timed_pair(partial(stack, x), partial(_backward_with, torch.ones_like(x)),
                                                   device, budget_s, cold=False, min_reps=TP_REPS))
            out.append([TP_MEASURED, h, LAYER_HEADS, seq, tokens, f, b, f, f + b])
    return out


def _backward_with(grad: torch.Tensor, out: torch.Tensor) -> None:
    out.backward(grad)


def _sum_backward(out: torch.Tensor) -> None:
    out.sum().backward()


def measure_blockwise(dtype: str, device: torch.device, budget_s: float = 0.05) -> list[list[float]]:
    """[[cp, hidden, seq, tokens, forward_s, backward_s], ...]: the context-parallel attention the runtime runs
    (``tensor_parallel.context_parallel``: this rank's two zig-zag chunks against every chunk of the sequence,
    block by block, ``LAYER_HEADS`` heads) for one rank of ``cp`` = 2 holding ``tokens`` of a micro-batch of
    ``seq``-token sequences, over ``layer_grid``'s hidden sizes. The ring runs these blocks in cp steps and
    the all-gather in one call: the same blocks, here in one (communication is priced apart)."""
    from modelpar.tensor_parallel.context_parallel import _ChunkAttention, chunks_of

    hiddens, token_counts, seq = layer_grid(device.type, budget_s)
    out = []
    for cp in (2,):
        every = tuple(c for r in range(cp) for c in chunks_of(r, cp))
        for h in hiddens:
            for tokens in token_counts:
                b, d = max(1, tokens * cp // seq), h // LAYER_HEADS
                q = torch.randn(b, LAYER_HEADS, seq // cp, d, device=device, dtype=DTYPES[dtype], requires_grad=True)
                k, v = (torch.randn(b, LAYER_HEADS, seq, d, device=device, dtype=DTYPES[dtype], requires_grad=True)
                        for _ in range(2))
                args = (q, k, v, chunks_of(0, cp), every, d ** -0.5)
                forward, backward = timed_pair(partial(_ChunkAttention.apply, *args), _sum_backward, device,
                                               budget_s)
                out.append([cp, h, seq, b * seq // cp, forward, backward])
    return out


def _tiny(hidden: int, layers: int, seq: int, vocab: int) -> Any:
    from modelpar.model import ModelConfig

    return ModelConfig(hidden=hidden, heads=LAYER_HEADS if hidden % LAYER_HEADS == 0 else 1, layers=layers,
                       seq_len=seq, vocab_size=vocab)


def _end_times(embed: Any, norm: Any, loss_fn: Any, ids: torch.Tensor, x: torch.Tensor,
               device: torch.device, budget_s: float) -> list[float]:
    """Embedding forward and backward, norm + head + loss forward and backward."""
    grad = torch.ones(*ids.shape, x.shape[-1], device=device, dtype=x.dtype)
    ef, eb = timed_pair(lambda: embed(ids), lambda out: out.backward(grad), device, budget_s)
    hf, hb = timed_pair(lambda: loss_fn(norm(x), ids), lambda out: out.backward(), device, budget_s)
    return [ef, eb, hf, hb]


def measure_ends(dtype: str, device: torch.device, budget_s: float = 0.05) -> list[list[float]]:
    """[[hidden, tokens, vocab, embed_fwd_s, embed_bwd_s, head_fwd_s, head_bwd_s], ...] over ``layer_grid``: the
    embedding (ids in, no input gradient) and the final norm + output layer + cross entropy (a hidden state in)."""
    from modelpar.model import LMLoss, build_stage

    hiddens, token_counts, seq = layer_grid(device.type, budget_s)
    out = []
    for h in hiddens:
        cfg = _tiny(h, 1, seq, END_VOCAB)
        model = build_stage(cfg, dtype=DTYPES[dtype], device=device, head_in_loss=True)
        assert model.embed is not None and model.norm is not None and model.head is not None
        loss_fn = LMLoss(cfg.vocab_size, head=model.head)  # the trainer's head and loss (one chunk at these sizes)
        embed, norm = model.embed, model.norm
        for tokens in token_counts:
            b = tokens // seq
            ids = torch.randint(0, cfg.vocab_size, (b, seq), device=device)
            x = torch.randn(b, seq, h, device=device, dtype=DTYPES[dtype], requires_grad=True)
            out.append([h, tokens, END_VOCAB, *_end_times(embed, norm, loss_fn, ids, x, device, budget_s)])
    return out


def measure_runtime(device: torch.device, budget_s: float = 0.05) -> list[float]:
    """[action_s, step_s]: what ``PipelineRunner`` adds to each forward or backward action beyond computing it,
    and to each step beyond its actions (a one-stage 1F1B step of a tiny model at 1 and 8 micro-batches, beside
    the same micro-batches' forward, loss and backward called directly)."""
    from modelpar.model import LMLoss, build_stage
    from modelpar.pipeline.runner import PipelineRunner
    from modelpar.schedules import get_schedule

    cfg = _tiny(16, 1, 8, 64)
    model = build_stage(cfg, device=device)
    loss_fn = LMLoss(cfg.vocab_size)
    steps = {}
    for m in (1, 8):
        runner = PipelineRunner(get_schedule("1f1b", ranks=1, microbatches=m), {0: model}, loss_fn, group=None)
        ids = torch.randint(0, cfg.vocab_size, (m, cfg.seq_len), device=device)
        steps[m] = timed(partial(runner.step, ids, ids), device, budget_s)
    one = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), device=device)
    direct = timed(lambda: loss_fn(model(one), one).backward(), device, budget_s)
    per_microbatch = (steps[8] - steps[1]) / 7
    return [max(0.0, (per_microbatch - direct) / 2), max(0.0, steps[1] - per_microbatch)]


OPTIMIZER_MODELS = ((32, 1), (32, 4), (64, 2), (128, 1), (128, 2), (256, 2))  # (hidden, layers): tensors, bytes apart


def _optimizer_step(hidden: int, layers: int, device: torch.device, budget_s: float) -> tuple[int, int, float]:
    """(tensors, AdamW state bytes, seconds) of one optimizer step of a ``hidden`` × ``layers`` model."""
    from modelpar.model import build_stage
    from modelpar.training.optimizer import param_groups

    model = build_stage(_tiny(hidden, layers, 8, 256), device=device)
    params = [p for p in model.parameters() if p.requires_grad]
    flat = torch.zeros(sum(p.numel() for p in params), device=device)
    offset = 0
    for p in params:  # gradients are views of one buffer, as the trainer's buckets hold them
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    flat.normal_()
    opt = torch.optim.AdamW(param_groups(params, 0.1), lr=1e-4, betas=(0.9, 0.95), eps=1e-8)

    def step() -> None:  # the trainer's step end: the norm, clipping's scaling, AdamW, the zeroing
        torch.linalg.vector_norm(flat, dtype=torch.float64).item()
        flat.mul_(0.5)
        opt.step()
        flat.zero_()

    seconds = timed(step, device, budget_s)
    return len(params), 2 * flat.numel() * flat.element_size(), seconds


def measure_optimizer(device: torch.device, budget_s: float = 0.05) -> list[list[float]]:
    """[[tensors, AdamW state bytes, seconds], ...] of a step's end over ``OPTIMIZER_MODELS``: the rows
    ``fit_optimizer`` fits once every rank's are in (``calibrate.run.slowest`` takes each row's slowest rank before
    the fit, not the worst of each rank's fitted terms). With a CPU process group (the clusters of ``modelpar
    calibrate``), the trainer's own step end (``trainer_step_end``); without one (a GPU measured in this process),
    its norm, AdamW update and zeroing alone (``_optimizer_step``)."""
    if device.type == "cpu" and dist.is_initialized():
        return [list(map(float, trainer_step_end(h, n, budget_s))) for h, n in OPTIMIZER_MODELS]
    return [list(map(float, _optimizer_step(h, n, device, budget_s))) for h, n in OPTIMIZER_MODELS]


STEP_END_STEPS = 8  # steps of each training ``trainer_step_end`` runs; the first (allocation, first touch) left out


def trainer_step_end(hidden: int, layers: int, budget_s: float) -> tuple[int, int, float]:
    """(tensors, AdamW state bytes, seconds) of the step end of a ``hidden`` × ``layers`` model as ``modelpar train``
    runs it on every rank of the process group (data parallel over all of them, ZeRO 0): the batch, the gradient
    norm and clipping with its all-reduce, the stop agreement, AdamW and the zeroing (``TrainResult.step_end_times``,
    their mean after the first step). Measured whole because the parts a synthetic step leaves out came to 1.0-1.6
    ms a step on a 2-core VM (h64-h128, one rank: 3-4% of the step, every prediction that much too fast)."""
    from modelpar.training import TrainConfig, train

    world = dist.get_world_size()
    steps = STEP_END_STEPS if budget_s >= QUICK_S else 5  # 4 steps kept: one paused step is left out (steady_mean)
    # a replica's 8 sequences of 64 tokens in 2 microbatches: the forward and backward leave the caches as a training
    # step's do (a step end after the compute of one 16-token sequence ran a third faster than in a run of the
    # validation's models)
    cfg = TrainConfig(model=_tiny(hidden, layers, 64, 256), tp=1, pp=1, dp=world, steps=steps, batch_size=8 * world,
                      microbatches=2, eval_every=0, eval_batches=1, warmup=1, timeout=300.0)
    result = train(cfg)
    return result.optimizer_tensors, result.optimizer_state_bytes, steady_mean(result.step_end_times[1:])


def fit_optimizer(rows: Sequence[Sequence[float]]) -> list[float]:
    """[latency_s, per_tensor_s, GB/s] fitted to (tensors, bytes, seconds) rows by least squares (normal
    equations, 3 × 3), each term kept non-negative (a negative one is dropped and the rest refitted)."""
    terms = [0, 1, 2]
    while True:
        coef = _least_squares([[(1.0, float(t), b / 1e9)[i] for i in terms] for t, b, _ in rows],
                              [s for _, _, s in rows])  # bytes in GB: the normal equations stay well scaled
        if all(c >= 0 for c in coef) or len(terms) == 1:
            break
        terms = [i for i, c in zip(terms, coef) if c >= 0] or [0]
    full = dict.fromkeys(range(3), 0.0)
    full.update({i: max(0.0, c) for i, c in zip(terms, coef)})
    return [full[0], full[1], 1.0 / full[2] if full[2] > 0 else 1e6]  # s per GB -> GB/s


def _least_squares(x: list[list[float]], y: list[float]) -> list[float]:
    """Solve min ‖x·c − y‖ by the normal equations (Gaussian elimination; a few unknowns)."""
    n = len(x[0])
    a = [[sum(r[i] * r[j] for r in x) for j in range(n)] + [sum(r[i] * v for r, v in zip(x, y))] for i in range(n)]
    for i in range(n):
        pivot = max(range(i, n), key=lambda k: abs(a[k][i]))
        a[i], a[pivot] = a[pivot], a[i]
        if abs(a[i][i]) < 1e-300:
            return [0.0] * n
        for k in range(n):
            if k != i:
                f = a[k][i] / a[i][i]
                a[k] = [u - f * w for u, w in zip(a[k], a[i])]
    return [a[i][n] / a[i][i] for i in range(n)]
