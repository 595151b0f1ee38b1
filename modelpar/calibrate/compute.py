"""Compute throughput on one rank: GEMMs over a transformer layer's shapes, attention, element-wise, op latency.

Every rank of a calibration group runs these at once (a barrier before each measurement), so the
figures are what a rank gets while its neighbours compute too: on a CPU the cores are shared as
``modelpar train`` shares them. Times are medians of repeated runs after a warm-up.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "DTYPES",
    "cpu_model",
    "flush_cache",
    "gemm_shapes",
    "measure_attention",
    "measure_elementwise",
    "measure_matmul",
    "measure_op_latency",
    "repeated",
    "steady_mean",
    "sync",
    "timed",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def cpu_model() -> str:
    """This machine's CPU by name (/proc/cpuinfo's model name; else what platform knows, without starting `uname`)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() or "cpu"


def gemm_shapes(device: str) -> list[tuple[int, int, int]]:
    """(m, n, k) of x[m×k]·w[k×n] a layer of width w uses: square (attention projections), w → 3w (fused
    QKV), w → 4w and 4w → w (the MLP), at several token counts m; larger on a GPU."""
    tokens, widths = ((64, 256, 1024), (64, 128, 256, 512)) if device == "cpu" else \
        ((512, 2048, 8192), (512, 1024, 2048, 4096))
    return [(m, n, k) for m in tokens for w in widths for k, n in ((w, w), (w, 3 * w), (w, 4 * w), (4 * w, w))]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


FLUSH_BYTES = {"cpu": 16 << 20, "cuda": 256 << 20}  # several times a core's (a GPU's) last private cache level
_flush_buffers: dict[str, torch.Tensor] = {}


def flush_cache(device: torch.device) -> None:
    """Overwrite a buffer larger than the caches, so the next call finds its weights and inputs cold, as a layer
    does in a step where the other layers ran in between (triton's ``do_bench`` does the same on a GPU)."""
    key = str(device)
    if key not in _flush_buffers:
        _flush_buffers[key] = torch.empty(FLUSH_BYTES.get(device.type, 16 << 20) // 4, device=device)
    _flush_buffers[key].zero_()
    sync(device)


def repeated(once: Callable[[], tuple[float, ...]], device: torch.device, budget_s: float = 0.05, min_reps: int = 3,
             reps: int | None = None, cold: bool = False) -> list[tuple[float, ...]]:
    """What ``once()`` timed (a tuple of seconds) over at least ``min_reps`` calls within ``budget_s`` (at most 200),
    or exactly ``reps`` (a collective: every rank must run it as often); ``cold``: the caches flushed before each
    call (``flush_cache``, untimed). The caller warms up first. Under a process group every rank starts
    together (a barrier), so concurrent ranks overlap."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    runs: list[tuple[float, ...]] = []
    end = time.perf_counter() + budget_s
    while len(runs) < (reps or min_reps) or (reps is None and time.perf_counter() < end):
        if cold:
            flush_cache(device)
        runs.append(once())
        if len(runs) >= (reps or 200):
            break
    return runs


PAUSE = 2.0  # a run this many times its median or more met a pause of the machine, not the work's own variation


def steady_mean(times: Sequence[float]) -> float:
    """The mean of the runs below ``PAUSE`` × their median. A step of many parts meets the machine's frequent
    small delays, which the mean keeps; a rare pause of tens of ms falls in few steps and not in their median,
    but in the mean of a handful of runs it moves a table cell by half (a 6-row optimizer fit's bandwidth:
    0.5-2.6 GB/s over three calibrations of one machine), and the slowest rank's cell keeps it."""
    cut = PAUSE * statistics.median(times)
    return statistics.fmean([t for t in times if t < cut])


def timed(fn: Callable[[], object], device: torch.device, budget_s: float = 0.05, min_reps: int = 3,
          reps: int | None = None, statistic: Callable[[list[float]], float] = statistics.median,
          cold: bool = False) -> float:
    """Median (or ``statistic``) seconds of one ``fn()`` call: one warm-up, then ``repeated``'s runs."""
    def once() -> tuple[float]:
        t0 = time.perf_counter()
        fn()
        sync(device)
        return (time.perf_counter() - t0,)

    fn()
    sync(device)
    return statistic([t for (t,) in repeated(once, device, budget_s, min_reps, reps, cold)])


def measure_matmul(dtype: str, device: torch.device, shapes: list[tuple[int, int, int]],
                   budget_s: float = 0.05) -> list[list[float]]:
    """[[m, n, k, TFLOP/s], ...] of x[m×k] @ w[k×n] in ``dtype`` (2·m·n·k FLOPs each)."""
    points = []
    for m, n, k in shapes:
        x = torch.randn(m, k, dtype=DTYPES[dtype], device=device)
        w = torch.randn(k, n, dtype=DTYPES[dtype], device=device)
        def product(x: torch.Tensor = x, w: torch.Tensor = w) -> torch.Tensor:
            return x @ w

        seconds = timed(product, device, budget_s)
        points.append([m, n, k, 2.0 * m * n * k / seconds / 1e12])
    return points


def measure_attention(dtype: str, device: torch.device, budget_s: float = 0.1) -> float:
    """TFLOP/s of causal scaled-dot-product attention, forward and backward, at two layer shapes.

    FLOPs as Megatron counts them: 4·b·a·s²·d forward (QKᵀ and ·V, no causal halving), 3× with the backward.
    """
    flops = seconds = 0.0
    shapes = ((4, 4, 64, 32), (4, 4, 256, 32)) if device.type == "cpu" else ((8, 16, 1024, 64), (4, 16, 4096, 64))
    for b, a, s, d in shapes:
        q, k, v = (torch.randn(b, a, s, d, dtype=DTYPES[dtype], device=device, requires_grad=True) for _ in range(3))

        def step(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> None:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        seconds += timed(step, device, budget_s)
        flops += 3 * 4.0 * b * a * s * s * d
    return flops / seconds / 1e12


def measure_elementwise(device: torch.device, budget_s: float = 0.05) -> float:
    """GB/s of memory-bound element-wise work (GeLU and an add over 4 M fp32 values): bytes read + written / s."""
    n = (1 << 22) if device.type == "cpu" else (1 << 26)
    x, y = torch.randn(n, device=device), torch.randn(n, device=device)
    gelu = timed(lambda: F.gelu(x), device, budget_s)  # read x, write the result
    add = timed(lambda: x + y, device, budget_s)  # read x and y, write the result
    return (2 * n * 4 + 3 * n * 4) / (gelu + add) / 1e9


def measure_op_latency(device: torch.device, budget_s: float = 0.05) -> float:
    """Seconds per dispatched op with autograd (a tiny linear layer, forward and backward: about 4 ops)."""
    x = torch.randn(2, 8, device=device, requires_grad=True)
    w = torch.randn(8, 8, device=device, requires_grad=True)

    def step() -> None:
        F.linear(x, w).sum().backward()

    return timed(step, device, budget_s) / 4
