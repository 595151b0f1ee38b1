"""How many micro-batches: measure t(b), fit t(b) ≈ α + β·b, and minimise the GPipe step (reference §2.4).

Each micro-batch of b rows costs a stage α + β·b: a fixed α (kernel launches, hand-offs, small
matrices that leave the cores idle) plus β per row. With K stages, a batch of N rows in M
micro-batches and backward = 2 × forward, one GPipe step takes (§2.3, §2.4)::

    T(M) = 3 · (M + K − 1) · (α + β·N/M)

More micro-batches shrink the bubble but pay α more often; dT/dM = 0 gives
M* = √((K − 1)·β·N/α). Exercise 3 of the reference (K = 4, α = 0.2 ms, β = 0.01 ms, N = 1024):
T(4) = 58.0 ms, T(64) = 72.4 ms, M* ≈ 12.4.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter

import torch

from modelpar._validate import check_int, check_number

__all__ = [
    "LinearFit",
    "MicrobatchRow",
    "MicrobatchScan",
    "fit_linear",
    "measure_stage_times",
    "microbatch_table",
    "optimal_microbatches",
    "predicted_step_time",
]


@dataclass(frozen=True)
class LinearFit:
    """Least-squares line t(b) = alpha + beta·b through measured (rows, seconds) points."""

    alpha: float  # fixed cost of one micro-batch, seconds
    beta: float  # cost of one more row, seconds
    r2: float  # coefficient of determination: 1 is a perfect line

    def __call__(self, rows: float) -> float:
        return self.alpha + self.beta * rows


def fit_linear(rows: Sequence[float], times: Sequence[float], relative: bool = True) -> LinearFit:
    """Least squares for t = α + β·b; needs two or more distinct ``rows`` and positive ``times``.

    ``relative`` weighs each point by 1/t² (least squares on the relative error): timings span
    decades and their noise is proportional to them, so the small micro-batches that fix α are not
    drowned by the large ones. R² is computed with the same weights.
    """
    if len(rows) != len(times):
        raise ValueError(f"rows and times must have the same length, got {len(rows)} and {len(times)}")
    if len(set(rows)) < 2:
        raise ValueError(f"rows must hold at least two distinct values, got {list(rows)}")
    if any(not t > 0 for t in times):
        raise ValueError(f"times must all be > 0, got {list(times)}")
    w = [1.0 / t**2 if relative else 1.0 for t in times]
    sw = sum(w)
    mean_b = sum(wi * b for wi, b in zip(w, rows)) / sw
    mean_t = sum(wi * t for wi, t in zip(w, times)) / sw
    sbb = sum(wi * (b - mean_b) ** 2 for wi, b in zip(w, rows))
    sbt = sum(wi * (b - mean_b) * (t - mean_t) for wi, b, t in zip(w, rows, times))
    beta = sbt / sbb
    alpha = mean_t - beta * mean_b
    stt = sum(wi * (t - mean_t) ** 2 for wi, t in zip(w, times))
    sse = sum(wi * (t - alpha - beta * b) ** 2 for wi, b, t in zip(w, rows, times))
    return LinearFit(alpha, beta, 1.0 - sse / stt if stt > 0 else 1.0)


def optimal_microbatches(alpha: float, beta: float, batch: int, stages: int) -> float:
    """M* = √((K − 1)·β·N/α), the minimum of 3(M + K − 1)(α + βN/M) over real M ≥ 1 (§2.4).

    At least 1: with K = 1 there is no bubble to fill and one microbatch is best.
    """
    alpha = check_number("alpha", alpha, 0.0, strict=True)
    beta = check_number("beta", beta, 0.0)
    n = check_int("batch", batch, minimum=1)
    k = check_int("stages", stages, minimum=1)
    return max(1.0, math.sqrt((k - 1) * beta * n / alpha))


def predicted_step_time(
    alpha: float, beta: float, batch: int, stages: int, microbatches: int, backward_ratio: float = 2.0
) -> float:
    """(1 + r)·(M + K − 1)·(α + β·N/M): GPipe's step with backward = r × forward (§2.3, §2.4)."""
    check_number("alpha", alpha, 0.0)
    check_number("beta", beta, 0.0)
    n = check_int("batch", batch, minimum=1)
    k = check_int("stages", stages, minimum=1)
    m = check_int("microbatches", microbatches, minimum=1, maximum=n)
    r = check_number("backward_ratio", backward_ratio, 0.0)
    return (1 + r) * (m + k - 1) * (alpha + beta * n / m)


def measure_stage_times(
    stage: Callable[[torch.Tensor], object],
    rows: Sequence[int],
    make_input: Callable[[int], torch.Tensor],
    repeats: int = 5,
    min_seconds: float = 2e-3,
) -> list[float]:
    """Forward time in seconds of ``stage(make_input(b))`` for each b in ``rows``: the fastest repeat.

    Runs under the caller's grad mode (a training forward builds the graph). Each repeat loops
    enough calls to last ``min_seconds`` so that micro-second forwards are timed reliably; the
    fastest repeat is kept because other processes can only slow a run down (as ``timeit`` does).
    """
    repeats = check_int("repeats", repeats, minimum=1)
    check_number("min_seconds", min_seconds, 0.0)
    out = []
    for j, b in enumerate(rows):
        x = make_input(check_int(f"rows[{j}]", b, minimum=1))
        start = perf_counter()
        stage(x)  # warm-up, and the calibration of how many calls make one repeat
        number = max(1, math.ceil(min_seconds / max(perf_counter() - start, 1e-9)))
        samples = []
        for _ in range(repeats):
            start = perf_counter()
            for _ in range(number):
                stage(x)
            samples.append((perf_counter() - start) / number)
        out.append(min(samples))
    return out


@dataclass(frozen=True)
class MicrobatchRow:
    """One line of §2.4's table: M micro-batches of ``rows`` rows each."""

    microbatches: int
    rows: int
    stage_time: float  # measured t(rows), seconds
    measured_step: float  # 3(M + K − 1)·t(rows) with the measured t
    predicted_step: float  # 3(M + K − 1)(α + βN/M) with the fitted α, β


@dataclass(frozen=True)
class MicrobatchScan:
    """The measured table, the fit through it and the optimum it predicts."""

    batch: int
    stages: int
    rows: list[MicrobatchRow]
    fit: LinearFit
    m_star: float

    @property
    def best_measured(self) -> MicrobatchRow:
        return min(self.rows, key=lambda r: r.measured_step)

    def format(self) -> str:
        """The table with English labels, times in milliseconds (and α in microseconds)."""
        lines = [f"K = {self.stages} stages, batch N = {self.batch} rows, backward = 2 x forward",
                 f"{'M':>5} {'rows b':>7} {'t(b) ms':>9} {'step ms':>9} {'fit ms':>9}"]
        best = self.best_measured.microbatches
        for r in self.rows:
            mark = "  <- fastest measured" if r.microbatches == best else ""
            lines.append(f"{r.microbatches:>5} {r.rows:>7} {r.stage_time * 1e3:>9.3f} "
                         f"{r.measured_step * 1e3:>9.2f} {r.predicted_step * 1e3:>9.2f}{mark}")
        f = self.fit
        lines.append(f"fit t(b) = {f.alpha * 1e6:.1f} us + {f.beta * 1e6:.3f} us * b   (R^2 = {f.r2:.4f})")
        lines.append(f"M* = sqrt((K - 1) * beta * N / alpha) = {self.m_star:.1f}")
        return "\n".join(lines)


def microbatch_table(
    stage: Callable[[torch.Tensor], object],
    make_input: Callable[[int], torch.Tensor],
    batch: int,
    stages: int,
    microbatch_counts: Sequence[int],
    repeats: int = 5,
) -> MicrobatchScan:
    """Measure t(⌈N/M⌉) for each M, fit α + β·b, and tabulate measured vs predicted step times."""
    n = check_int("batch", batch, minimum=1)
    k = check_int("stages", stages, minimum=1)
    counts = [check_int(f"microbatch_counts[{j}]", m, minimum=1, maximum=n) for j, m in enumerate(microbatch_counts)]
    sizes = [math.ceil(n / m) for m in counts]
    if len(set(sizes)) < 2:
        raise ValueError(f"microbatch_counts must give at least two different micro-batch sizes, got {counts}")
    times = measure_stage_times(stage, sizes, make_input, repeats)
    fit = fit_linear(sizes, times)
    if fit.alpha <= 0 or fit.beta < 0:
        raise ValueError(f"the fit t(b) = {fit.alpha:.3g} + {fit.beta:.3g}·b has no positive fixed cost; "
                         "time larger micro-batch sizes (raise batch) or more repeats")
    rows = [MicrobatchRow(m, b, t, 3 * (m + k - 1) * t, predicted_step_time(fit.alpha, fit.beta, n, k, m))
            for m, b, t in zip(counts, sizes, times)]
    return MicrobatchScan(n, k, rows, fit, optimal_microbatches(fit.alpha, fit.beta, n, k))
