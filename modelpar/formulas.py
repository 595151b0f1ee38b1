"""Closed-form formulas of the reference text, each a small pure function with its source.

A leaf shared by the simulator's closed forms, the tensor-parallel communication accounting and
the cost model (which re-exports them): plain numbers in, and nothing imported but the argument
checks, so importing the simulator does not load the planner.
"""

from __future__ import annotations

from modelpar._validate import check_int, check_number

__all__ = [
    "allgather_bytes",
    "allreduce_bytes",
    "bandwidth_demand",
    "bubble_fraction_of_step",
    "bubble_over_ideal_compute",
    "fused_cross_entropy_bytes",
    "gpt_params",
    "logits_allgather_bytes",
    "megatron_flops",
    "pipeline_speedup",
    "tp_comm_compute_ratio",
    "tp_layer_comm_bytes",
    "tp_layer_flops",
]


# --- collectives (ring algorithms, bytes each GPU sends) -----------------------------------
def allreduce_bytes(size_bytes: float, n: int) -> float:
    """Bytes one GPU sends in a ring all-reduce of ``size_bytes`` over ``n`` GPUs: 2(n − 1)/n · size."""
    n = check_int("n", n, minimum=1)
    return 2.0 * (n - 1) / n * check_number("size_bytes", size_bytes)


def allgather_bytes(size_bytes: float, n: int) -> float:
    """Bytes one GPU receives when all-gathering a ``size_bytes`` tensor over ``n`` GPUs: (n − 1)/n · size."""
    n = check_int("n", n, minimum=1)
    return (n - 1) / n * check_number("size_bytes", size_bytes)


# --- §5.5: output layer ---------------------------------------------------------------------
def logits_allgather_bytes(tokens: int, vocab: int, t: int, dtype_bytes: int = 2) -> float:
    """§5.5: per-GPU traffic to all-gather the vocabulary-parallel logits (b·s·V values, 16-bit)."""
    tokens = check_int("tokens", tokens, minimum=1)
    vocab = check_int("vocab", vocab, minimum=1)
    return allgather_bytes(tokens * vocab * check_int("dtype_bytes", dtype_bytes, minimum=1), t)


def fused_cross_entropy_bytes(tokens: int, t: int, scalars: int = 3, dtype_bytes: int = 4) -> float:
    """§5.5: per-GPU traffic of Megatron's fused cross entropy: all-reduces of 3 float32 scalars per token."""
    tokens = check_int("tokens", tokens, minimum=1)
    scalars = check_int("scalars", scalars, minimum=1)
    return allreduce_bytes(tokens * scalars * check_int("dtype_bytes", dtype_bytes, minimum=1), t)


# --- §5.6: tensor-parallel communication / computation ---------------------------------------
def tp_layer_flops(b: int, s: int, h: int, t: int) -> float:
    """§5.6: forward + backward FLOPs of one transformer layer on one of ``t`` GPUs, ≈ 72·b·s·h²/t."""
    b, s = check_int("b", b, minimum=1), check_int("s", s, minimum=1)
    h, t = check_int("h", h, minimum=1), check_int("t", t, minimum=1)
    return 72.0 * b * s * h * h / t


def tp_layer_comm_bytes(b: int, s: int, h: int, t: int, allreduces: int = 4, dtype_bytes: int = 2) -> float:
    """§5.6: bytes one GPU sends per layer: ``allreduces`` ring all-reduces of a b·s·h activation.

    Four by default: f and g, forward and backward.
    """
    size = check_int("b", b, minimum=1) * check_int("s", s, minimum=1) * check_int("h", h, minimum=1) * dtype_bytes
    return check_int("allreduces", allreduces, minimum=0) * allreduce_bytes(size, t)


def tp_comm_compute_ratio(h: int, t: int, peak_flops: float, link_bytes_per_s: float) -> float:
    """§5.6: all-reduce time over compute time for one layer.

    b and s cancel, leaving 2(t − 1)/(9h) bytes/FLOP × peak/bandwidth.
    """
    peak = check_number("peak_flops", peak_flops, strict=True)
    bw = check_number("link_bytes_per_s", link_bytes_per_s, strict=True)
    return (tp_layer_comm_bytes(1, 1, h, t) / bw) / (tp_layer_flops(1, 1, h, t) / peak)


# --- Megatron counts (Narayanan et al. 2021, SC'21, appendix) ------------------------------------
def gpt_params(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """SC'21 eq. (2): P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h)) for a GPT with 4h MLP and learned positions."""
    l, h = check_int("layers", layers, minimum=1), check_int("hidden", hidden, minimum=1)
    v, s = check_int("vocab", vocab, minimum=1), check_int("seq", seq, minimum=1)
    return 12.0 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: bool = True) -> float:
    """SC'21 eq. (3): FLOPs per iteration with full recomputation, 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)).

    Without recomputation: 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)).
    """
    bsz, s = check_int("batch", batch, minimum=1), check_int("seq", seq, minimum=1)
    l, h = check_int("layers", layers, minimum=1), check_int("hidden", hidden, minimum=1)
    v = check_int("vocab", vocab, minimum=1)
    if recompute:
        return 96.0 * bsz * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72.0 * bsz * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


# --- §2.3 / §4.2 / §6.3: pipeline bubble -------------------------------------------------------
def bubble_fraction_of_step(stages: int, microbatches: int) -> float:
    """§2.3 (GPipe, 1F1B): idle time as a fraction of the step, (K − 1)/(M + K − 1)."""
    k = check_int("stages", stages, minimum=1)
    m = check_int("microbatches", microbatches, minimum=1)
    return (k - 1) / (m + k - 1)


def bubble_over_ideal_compute(p: int, m: int, v: int = 1) -> float:
    """Megatron (SC'21 §2.2): idle time over the ideal (bubble-free) compute time, (1/v)·(p − 1)/m.

    §6.3: = (n/t − d)/B when m = B/d. It is (K − 1)/M where ``bubble_fraction_of_step`` is (K − 1)/(M + K − 1).
    """
    p = check_int("p", p, minimum=1)
    m = check_int("m", m, minimum=1)
    return (p - 1) / (check_int("v", v, minimum=1) * m)


def pipeline_speedup(stages: int, microbatches: int, comm: float = 0.0, backward_ratio: float = 2.0) -> float:
    """§2.3 throughput table: GPipe throughput over one GPU holding the whole model.

    With no transfer cost it is K·M/(M + K − 1). ``comm`` is one stage-to-stage transfer in units of a
    stage's forward time; transfers of later microbatches hide under compute, so only the fill and
    drain pay them: step = (M + K − 1)(1 + r) + 2(K − 1)·comm, in stage-forward units (r = backward/forward).
    """
    k = check_int("stages", stages, minimum=1)
    m = check_int("microbatches", microbatches, minimum=1)
    c = check_number("comm", comm)
    r = check_number("backward_ratio", backward_ratio)
    return k * m * (1 + r) / ((m + k - 1) * (1 + r) + 2 * (k - 1) * c)


# --- §1.3: bytes per second each kind of parallelism needs ----------------------------------
def bandwidth_demand(
    layers: int, hidden: int, seq: int, params: float, peak_flops: float, gpus: int = 8, dtype_bytes: int = 2
) -> dict[str, float]:
    """§1.3: bytes/s each GPU must send to keep up with its compute, for one sequence on ``gpus`` GPUs.

    Same model, same ``gpus`` for all three: pipeline (``gpus`` stages of layers/gpus layers; a middle
    stage sends one s×h activation forward and one gradient backward), tensor (t = ``gpus``, 4
    all-reduces of s×h per layer, §5.6) and data (d = ``gpus``, one all-reduce of 16-bit gradients
    of the whole model). Compute per GPU is forward + backward at ``peak_flops``: 72·s·h² per layer
    (§5.6) for pipeline and tensor, 6·P·s for data.
    """
    l, h, s = check_int("layers", layers, minimum=1), check_int("hidden", hidden, minimum=1), check_int("seq", seq, minimum=1)
    n = check_int("gpus", gpus, minimum=1)
    peak = check_number("peak_flops", peak_flops, strict=True)
    p_count = check_number("params", params, strict=True)
    act = s * h * dtype_bytes
    layer_time = tp_layer_flops(1, s, h, 1) / peak
    return {
        "pipeline": 2 * act / (layer_time * l / n),
        "tensor": tp_layer_comm_bytes(1, s, h, n, dtype_bytes=dtype_bytes) / (layer_time / n),
        "data": allreduce_bytes(p_count * dtype_bytes, n) / (6 * p_count * s / peak),
    }
