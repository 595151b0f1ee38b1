"""Fit DEFAULT's compute parameters on the published runs marked as the fit set, and only on them.

    python benchmarks/fit_costmodel.py

Coordinate descent over a grid of each parameter (GEMM curve half-points, element-wise passes,
per-kernel latency), minimising the rms of log(predicted / measured step time) over the runs whose
``fitted`` is ``published.GRID`` (SC'21 Table 1, Korthikanti et al.'s SP + selective MFU). The held-out
runs are only reported, never used. H100 runs take MODERN's differences on top of the candidate.
"""

from __future__ import annotations

import math

from modelpar.costmodel import DEFAULT, MODERN, Assumptions
from modelpar.costmodel.published import GRID, PUBLISHED, PublishedRun, mean_abs_error, validate

GRIDS: dict[str, list[float]] = {
    "gemm_tokens_half": [64, 96, 128, 160, 192, 256, 320, 384, 512],
    "gemm_width_half": [128, 160, 192, 224, 256, 320, 384, 512],
    "elementwise_passes": [0.5, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0],
    "layer_latency_s": [0.0, 20e-6, 40e-6, 60e-6, 80e-6, 100e-6, 150e-6],
}
MODERN_CHANGES = {k: getattr(MODERN, k) for k in ("flash_attention", "dp_overlap", "grad_bytes", "memory_gib",
                                                  "memory_reserve_gb")}


def rows_for(runs: list[PublishedRun], a: Assumptions) -> list:
    a100 = [r for r in runs if "h100" not in r.command]
    h100 = [r for r in runs if "h100" in r.command]
    return validate(a100, a) + (validate(h100, a.with_(**MODERN_CHANGES)) if h100 else [])


def rms_log(a: Assumptions, runs: list[PublishedRun]) -> float:
    rows = rows_for(runs, a)
    return math.sqrt(sum(math.log(1 + r.error) ** 2 for r in rows) / len(rows))


def main() -> None:
    fit = [r for r in PUBLISHED if r.fitted == GRID]
    held = [r for r in PUBLISHED if not r.fitted]
    a, best = DEFAULT, rms_log(DEFAULT, fit)
    print(f"DEFAULT: rms log error on the fit set {best:.4f}")
    for sweep in range(5):
        improved = False
        for name, values in GRIDS.items():
            for value in values:
                score = rms_log(a.with_(**{name: value}), fit)
                if score < best - 1e-9:
                    a, best, improved = a.with_(**{name: value}), score, True
        print(f"sweep {sweep}: {best:.4f}", {k: getattr(a, k) for k in GRIDS})
        if not improved:
            break
    for label, runs in (("fit set", fit), ("held out", held)):
        for name, base in (("DEFAULT", DEFAULT), ("fitted", a)):
            rows = rows_for(runs, base)
            print(f"{label:<9} {name:<8} mean |error| {mean_abs_error(rows):6.2%}, worst {max(abs(r.error) for r in rows):6.2%}")


if __name__ == "__main__":
    main()
