"""The compute of the trainer's actions on a hardware profile: a layer, the stage ends, the runtime, the step's end.

Two ways to price a layer's forward and backward on one rank (no communication; ``local.py`` adds it):

- *composed* from the kernel fits (``kernel_layer``): its GEMMs at their shapes (forward; input and weight
  gradient in the backward), attention at the measured attention throughput (4·tokens·s·h/t FLOPs
  forward, twice that backward), ``OPS_FORWARD`` dispatched ops at the measured op latency (twice in
  the backward), and the bytes it keeps streamed twice (written forward, read back backward);
- *measured*: the profile's ``layer`` table (``calibrate.layers``: the model's own layer, forward and
  backward, with and without full recomputation, over a grid of hidden sizes and tokens per micro-batch at
  the run's process count). Inside the grid a layer costs its composition plus what the composition
  misses at the grid's shapes, interpolated (``residual``, log-bilinear in hidden and tokens): at a
  measured shape with t = 1 exactly the measurement; at t > 1, with another head count, sequence,
  MLP or vocabulary, the kernels' difference is the composition's (the per-op and thread hand-over
  costs the composition misses do not shrink with t). Outside the grid, or without a table, the composition.
  A ``--compile`` run reads the compiled layer's table instead (``layer_compiled``) where the profile has one
  (``compiled_measured``), on a GPU too; else it is priced as the eager run.

The stage ends (the embedding; the final norm, output layer and cross entropy) are priced alike from
the ``ends`` table; the runtime's own cost per action and per step from ``runtime_s``; the step's end
(gradient norm, AdamW, zeroing) from the ``optimizer`` fit, ``latency + tensors·per_tensor + state
bytes / bandwidth``. A profile without them (an older calibration, a data-sheet GPU) is priced by the
kernels alone, as before: per step ``OPS_STEP`` ops, the norm reading the gradients, AdamW reading and
writing 7 of its 4-byte words per parameter.

On a GPU profile every composed action is ``paced``: the host launches asynchronously, so an action takes
max(host time, kernel time), the host time being the ops the run really dispatches (``run.ops``, counted from
its model: ``costmodel.dispatch``; else the constants above) × the host's seconds per dispatched op
(``launch_seconds``); with the ops counted the measured ``layer`` and ``ends`` tables are left out
(``counted_on_gpu``). On a CPU host and device are the same threads: the sum, with the constants, as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from modelpar.costmodel.allocator import loss_chunk_tokens
from modelpar.costmodel.dispatch import DispatchCounts
from modelpar.costmodel.local_memory import LocalLayout, activation_parts
from modelpar.costmodel.measured import layer_gemms
from modelpar.costmodel.profiles import HardwareProfile

__all__ = ["OPS_FORWARD", "OPS_STEP", "LayerCost", "attention_seconds", "blockwise_seconds", "compiled_measured",
           "core_share", "counted_on_gpu", "dispatch_counts", "end_seconds", "grid_model", "interpolate", "kernel_ends",
           "kernel_layer", "launch_seconds", "layer_seconds", "matmul_seconds", "paced", "runtime_seconds",
           "step_end_seconds", "table_dtype"]

OPS_FORWARD = 12  # dispatched ops of a layer's forward (norms, GEMMs, attention, activation, residuals, views)
OPS_STEP = 40  # per step: gradient norm, clipping, the loss all-gather, AdamW's foreach kernels, zeroing


@dataclass(frozen=True)
class LayerCost:
    """Seconds of one layer's (or stage end's) compute for one micro-batch: forward, backward (the weight
    gradient included) and the weight gradient's part of it."""

    forward: float
    backward: float
    weight: float


def table_dtype(run: LocalLayout) -> str:
    """The measured tables a run's compute is priced from (fp8: the bf16 ones; no float8 tables are measured)."""
    return {"fp32": "fp32", "bf16": "bf16", "fp8": "bf16", "fp64": "fp64"}[run.precision]


def _ranks(run: LocalLayout, hw: HardwareProfile) -> int:
    return min(run.world, hw.devices_per_node)


def core_share(run: LocalLayout, hw: HardwareProfile, table: dict[str, Any] | None = None) -> float:
    """How much slower compute runs than the profile's ``table`` (default: the kernels') for this run:
    ranks / max(measured, cores) when a CPU run has more processes than both (the table measured with fewer;
    the cores are split further), else 1."""
    if hw.device != "cpu" or not hw.cores:
        return 1.0
    measured = int(hw.ranks_measured(run.world, table))
    return max(1.0, run.world / max(measured, hw.cores))


def matmul_seconds(run: LocalLayout, hw: HardwareProfile, m: int, n: int, k: int, ranks: int | None = None) -> float:
    """Seconds of x[m×k]·w[k×n] at the profile's throughput for the run's dtype and rank count (or ``ranks``
    processes), no core sharing."""
    ranks = ranks or _ranks(run, hw)
    tflops = hw.matmul_tflops(m, n, k, table_dtype(run), ranks) or hw.matmul_tflops(m, n, k, None, ranks)
    return 2.0 * m * n * k / ((tflops or hw.peak_tflops[hw.dtype]) * 1e12)


def attention_seconds(run: LocalLayout, hw: HardwareProfile, ranks: int | None = None) -> float:
    """Seconds of one layer's attention forward at the measured rate: each of the rank's tokens sees the whole
    sequence (4·tokens·s·h/t FLOPs)."""
    m = run.model
    tflops = hw.attention_tflops(table_dtype(run), ranks or _ranks(run, hw)) or hw.peak_tflops[hw.dtype]
    return 4.0 * run.tokens * m.seq * m.hidden / run.t / (tflops * 1e12)


def _stream(hw: HardwareProfile, ranks: int, nbytes: float) -> float:
    """Seconds to write ``nbytes`` of kept activations and read them back once, ``ranks`` processes computing."""
    return nbytes * 2 / hw.elementwise_bytes_per_s(ranks)


def kernel_layer(run: LocalLayout, hw: HardwareProfile, ranks: int | None = None) -> tuple[LayerCost, float]:
    """One layer composed from the kernel fits (module docstring; no recomputation, no core sharing) with the
    run's processes (or ``ranks``) computing, and its attention forward's seconds (what selective
    recomputation repeats)."""
    ranks = ranks or _ranks(run, hw)
    fwd = dgrad = wgrad = 0.0
    for mm, n, k in layer_gemms(run.model, run.tokens, run.t):
        fwd += matmul_seconds(run, hw, mm, n, k, ranks)
        dgrad += matmul_seconds(run, hw, mm, k, n, ranks)
        wgrad += matmul_seconds(run, hw, k, n, mm, ranks)
    attention = attention_seconds(run, hw, ranks)
    kept = _stream(hw, ranks, activation_parts(replace(run, recompute="none"), 0)[0]) / 2  # written / read back
    ops, op_s = dispatch_counts(run, hw), launch_seconds(hw, ranks)
    forward = paced(hw, fwd + attention + kept, ops.layer_forward * op_s)
    backward = paced(hw, dgrad + wgrad + 2 * attention + kept, ops.layer_backward * op_s)
    return LayerCost(forward, backward, wgrad), attention


_CONSTANT_OPS = DispatchCounts(OPS_FORWARD, 2 * OPS_FORWARD, 0, 0, 4, 8, OPS_STEP, 0)


def dispatch_counts(run: LocalLayout, hw: HardwareProfile) -> DispatchCounts:
    """The ops ``run`` dispatches on ``hw``: on a GPU those counted from its model (``run.ops``), else the constants
    (a CPU's fits were made with them): ``OPS_FORWARD`` a layer's forward and twice that its backward, 4 and 8 the
    head's, none the embedding's, ``OPS_STEP`` a step's."""
    return run.ops if counted_on_gpu(run, hw) and run.ops is not None else _CONSTANT_OPS


def counted_on_gpu(run: LocalLayout, hw: HardwareProfile) -> bool:
    """Is ``run`` priced on a GPU with its own dispatched ops counted? Then its layers and ends are composed and
    ``paced``, the measured ``layer`` and ``ends`` tables left out: they time a GPT layer in a plain dtype, whose
    dispatch (no autocast casts, no SwiGLU or rotary) is not the run's, and at the sizes one GPU trains the
    dispatch sets the pace, so their residual would carry the grid layer's host time over to the run."""
    return hw.device != "cpu" and run.ops is not None


def compiled_measured(run: LocalLayout, hw: HardwareProfile) -> bool:
    """Is ``run`` a ``--compile`` run whose layer the profile measured compiled (``layer_compiled``)? Then its
    layers are priced from that table, on a GPU too: the counted ops are eager dispatch, which a compiled block
    replaces by its generated kernels' launches."""
    return run.compiled and bool(hw.layer_rows(table_dtype(run), _ranks(run, hw), compiled=True))


def launch_seconds(hw: HardwareProfile, ranks: int) -> float:
    """Host seconds per dispatched op on ``hw``: on a GPU the measured launch cost (``HardwareProfile.launch``), else
    the op latency (a synchronised op's, an upper bound); on a CPU the op latency (the host runs the op itself);
    else 0."""
    launch = hw.launch(ranks) if hw.device != "cpu" else None
    return launch or hw.op_latency(ranks) or 0.0


def paced(hw: HardwareProfile, kernel_s: float, host_s: float) -> float:
    """Seconds of work whose kernels take ``kernel_s`` and whose dispatch takes the host ``host_s``: on a GPU the
    host launches asynchronously, so whichever is longer sets the pace; on a CPU the host runs the kernels
    itself, so they add."""
    return kernel_s + host_s if hw.device == "cpu" else max(kernel_s, host_s)


def kernel_ends(run: LocalLayout, hw: HardwareProfile, stage: int, ranks: int | None = None) -> tuple[LayerCost, LayerCost]:
    """(embedding, norm + head + loss) of ``stage`` composed from the kernel fits: the head's logits GEMM and
    its two backward GEMMs, 4 ops forward and 8 backward, and each end's kept bytes streamed; zero for an end
    the stage does not hold."""
    m, ranks = run.model, ranks or _ranks(run, hw)
    _, first, last = activation_parts(replace(run, recompute="none"), stage)
    ops, op_s = dispatch_counts(run, hw), launch_seconds(hw, ranks)
    streamed = _stream(hw, ranks, first) / 2
    embed = (LayerCost(paced(hw, streamed, ops.embed_forward * op_s), paced(hw, streamed, ops.embed_backward * op_s),
                       0.0) if stage == 0 else _ZERO)
    if stage != run.stages - 1:
        return embed, _ZERO
    head = matmul_seconds(run, hw, run.tokens, m.vocab // run.t, m.hidden, ranks)
    kept = _stream(hw, ranks, last) / 2
    host_f, host_b = ops.head(math.ceil(run.tokens / loss_chunk_tokens(run)))
    return embed, LayerCost(paced(hw, head + kept, host_f * op_s), paced(hw, 2 * head + kept, host_b * op_s), head)


_ZERO = LayerCost(0.0, 0.0, 0.0)


def grid_model(run: LocalLayout, hidden: int, heads: int, seq: int, tokens: int, vocab: int) -> LocalLayout:
    """``run`` reduced to what calibrate measured: t = cp = 1, a GPT layer (ffn 4h, biases, one key/value head
    per query head) of ``hidden`` and ``heads``, ``tokens`` per micro-batch of ``seq``-token sequences, the
    output layer over ``vocab``; no recomputation. Its kernels are priced at the run's process count (the
    ``ranks`` argument of ``kernel_layer``), as the table it stands for was measured."""
    model = replace(run.model, hidden=hidden, heads=heads, seq=seq, vocab=vocab, ffn=4 * hidden, kv_heads=0,
                    gated_mlp=False, bias=True, learned_positions=True, layers=1)
    return replace(run, model=model, t=1, p=1, v=1, d=1, cp=1, microbatches=1, batch=max(1, tokens // seq),
                   sequence_parallel=False, recompute="none", moe=None, ep=1)


def interpolate(rows: Sequence[Sequence[float]], keys: tuple[int, int], point: tuple[float, float],
                value: Callable[[Sequence[float]], Sequence[float]]) -> list[float] | None:
    """``value`` of the measured rows at ``point`` of the two ``keys`` columns: log-bilinear between the four
    grid rows around it (exact at a grid row); None when ``point`` lies outside the grid or a corner is missing."""
    if not rows:
        return None
    axes = [sorted({float(r[k]) for r in rows}) for k in keys]
    corners = []
    for axis, x in zip(axes, point):
        if not axis[0] <= x <= axis[-1]:
            return None
        hi = next(i for i, g in enumerate(axis) if g >= x)
        lo = hi if axis[hi] == x else hi - 1
        a, b = axis[lo], axis[hi]
        w = 0.0 if a == b else math.log(x / a) / math.log(b / a)
        corners.append(((a, 1.0 - w), (b, w)))
    by_key = {(float(r[keys[0]]), float(r[keys[1]])): r for r in rows}
    total: list[float] | None = None
    for x0, w0 in corners[0]:
        for x1, w1 in corners[1]:
            if w0 * w1 == 0.0:
                continue
            row = by_key.get((x0, x1))
            if row is None:
                return None
            got = [w0 * w1 * v for v in value(row)]
            total = got if total is None else [t + g for t, g in zip(total, got)]
    return total


def layer_seconds(run: LocalLayout, hw: HardwareProfile) -> LayerCost:
    """One layer's compute for one micro-batch on one rank, as ``run.recompute`` runs it (full: the forward
    without keeping, the backward with the forward again; selective: the attention forward again), × the core
    sharing (module docstring)."""
    composed, attention = kernel_layer(run, hw)
    m, ranks = run.model, _ranks(run, hw)
    compiled = compiled_measured(run, hw)
    rows = hw.layer_rows(table_dtype(run), ranks, compiled) if compiled or not counted_on_gpu(run, hw) else []
    full = run.recompute == "full"

    def residual(row: Sequence[float]) -> list[float]:
        at, _ = kernel_layer(grid_model(run, int(row[0]), int(row[1]), int(row[2]), int(row[3]), m.vocab), hw, ranks)
        measured_f, measured_b = (row[6], row[7]) if full else (row[4], row[5])
        expect_b = at.backward + at.forward if full else at.backward
        return [measured_f - at.forward, measured_b - expect_b]

    missed = interpolate(rows, (0, 3), (m.hidden, run.tokens), residual) if rows else None
    blocks = blockwise_seconds(run, hw)
    if blocks is not None:  # the runtime's block-by-block attention in place of fused attention at its rate
        composed = LayerCost(composed.forward + blocks[0] - attention, composed.backward + blocks[1] - 2 * attention,
                             composed.weight)
        attention = blocks[0]
    forward, backward = composed.forward, composed.backward + (composed.forward if full else 0.0)
    weight_share = composed.weight / backward if backward else 0.0
    if missed is not None:
        forward, backward = max(0.0, forward + missed[0]), max(0.0, backward + missed[1])
    if run.recompute == "selective":
        backward += attention
    weight = (backward - (attention if run.recompute == "selective" else 0.0)) * weight_share
    table = (hw.layer_compiled if compiled else hw.layer).get(table_dtype(run))
    share = core_share(run, hw, table if missed is not None else None)
    return LayerCost(forward * share, backward * share, weight * share)


def blockwise_seconds(run: LocalLayout, hw: HardwareProfile) -> tuple[float, float] | None:
    """(forward, backward) seconds of one layer's context-parallel attention on one rank, no core sharing: the
    measured blocks (``blockwise`` at the run's cp and sequence, interpolated in hidden and tokens) over its
    t-th of the heads; None at cp = 1 or outside what was measured."""
    rows = [r for r in hw.blockwise_rows(table_dtype(run), _ranks(run, hw)) if r[0] == run.cp and r[2] == run.model.seq]
    if run.cp == 1 or not rows:
        return None
    got = interpolate(rows, (1, 3), (run.model.hidden, run.tokens), lambda r: r[4:6])
    return None if got is None else (got[0] / run.t, got[1] / run.t)


def end_seconds(run: LocalLayout, hw: HardwareProfile, stage: int) -> LayerCost:
    """The embedding's (first stage) and the norm, head and loss's (last stage) compute for one micro-batch,
    measured (``ends``) inside its grid as ``layer_seconds`` is, else composed; × the core sharing."""
    embed, head = kernel_ends(run, hw, stage)
    m, ranks = run.model, _ranks(run, hw)
    rows = hw.end_rows(table_dtype(run), ranks) if not counted_on_gpu(run, hw) else []

    def residual(row: Sequence[float]) -> list[float]:
        e, h = kernel_ends(grid_model(run, int(row[0]), 1, m.seq, int(row[1]), int(row[2])), hw, 0, ranks)
        return [row[3] - e.forward, row[4] - e.backward, row[5] - h.forward, row[6] - h.backward]

    missed = interpolate(rows, (0, 1), (m.hidden, run.tokens), residual) if rows else None
    forward, backward, weight = embed.forward + head.forward, embed.backward + head.backward, head.weight
    if missed is not None:
        holds = (stage == 0, stage == 0, stage == run.stages - 1, stage == run.stages - 1)
        extra = [x if mine else 0.0 for x, mine in zip(missed, holds)]
        forward, backward = max(0.0, forward + extra[0] + extra[2]), max(0.0, backward + extra[1] + extra[3])
        weight = min(weight, backward)
    share = core_share(run, hw, hw.ends.get(table_dtype(run)) if missed is not None else None)
    return LayerCost(forward * share, backward * share, weight * share)


def runtime_seconds(run: LocalLayout, hw: HardwareProfile) -> tuple[float, float]:
    """(per action, per step) seconds the pipeline runtime adds beyond computing (0, 0 when not measured)."""
    measured = hw.runtime(_ranks(run, hw))
    share = core_share(run, hw, hw.runtime_s)
    return (measured[0] * share, measured[1] * share) if measured else (0.0, 0.0)


def step_end_seconds(run: LocalLayout, hw: HardwareProfile, tensors: int, gradient_bytes: float,
                     optimizer_bytes: float) -> float:
    """The step's gradient norm, AdamW update and zeroing on one rank holding ``tensors`` optimizer tensors (its
    parameters, or its bucket ranges under ZeRO): the measured fit (on a CPU the trainer's whole step end, the
    batch, the stop agreement and the norm's all-reduce in it: ``HardwareProfile.step_end_measured``), else the
    kernels (module docstring); × the core sharing."""
    ranks = _ranks(run, hw)
    fit = hw.optimizer_fit(ranks)
    if fit is not None:
        latency, per_tensor, gbps = fit
        seconds = latency + tensors * per_tensor + optimizer_bytes / (gbps * 1e9)
    else:  # the kernels (read g, w, m, v; write w, m, v) and the host's dispatch of the step's ops (``paced``)
        bandwidth = hw.elementwise_bytes_per_s(ranks)
        kernels = gradient_bytes / bandwidth + 7 * optimizer_bytes / 2 / bandwidth
        seconds = paced(hw, kernels, dispatch_counts(run, hw).step(run.model.layers // run.stages) * launch_seconds(hw, ranks))
    return seconds * core_share(run, hw, hw.optimizer if fit is not None else None)

