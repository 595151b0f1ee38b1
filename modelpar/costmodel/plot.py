"""Draw the planner's landscape: best step time and its memory for every (t, p), as two heat maps.

Imports matplotlib (not torch) when called, so ``modelpar plan`` without ``--plot`` stays light.
"""

from __future__ import annotations

from modelpar.costmodel.report import best_by_tp
from modelpar.costmodel.search import SearchResult

__all__ = ["plot_tp_grid"]


def plot_tp_grid(result: SearchResult, path: str, title: str, memory_gb: float) -> None:
    """Write a PNG/SVG (by ``path``'s suffix): step time (left) and memory per GPU (right) over t × p."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = best_by_tp(result)
    if not grid:
        raise ValueError("--plot: nothing to draw, no layout fits")
    ts = sorted({t for t, _ in grid})
    ps = sorted({p for _, p in grid})
    step = np.full((len(ts), len(ps)), np.nan)
    mem = np.full_like(step, np.nan)
    for (t, p), e in grid.items():
        step[ts.index(t), ps.index(p)] = e.step_time_s
        mem[ts.index(t), ps.index(p)] = e.memory_gb
    best = result.ranked[0].config
    fig, axes = plt.subplots(1, 2, figsize=(4 + 1.3 * len(ps), 1.2 + 0.75 * len(ts)), constrained_layout=True)
    panels = ((step, "step time (s), best layout per cell", "viridis_r", "{:.3g}"),
              (mem, f"memory per GPU (GB of {memory_gb:g})", "magma_r", "{:.0f}"))
    for ax, (data, label, cmap, fmt) in zip(axes, panels):
        im = ax.imshow(data, cmap=cmap, aspect="auto", origin="lower")
        fig.colorbar(im, ax=ax, shrink=0.85)
        ax.set_xticks(range(len(ps)), [str(p) for p in ps])
        ax.set_yticks(range(len(ts)), [str(t) for t in ts])
        ax.set_xlabel("pipeline stages p")
        ax.set_ylabel("tensor-parallel size t")
        ax.set_title(label, fontsize=10)
        lo, hi = np.nanmin(data), np.nanmax(data)
        for i in range(len(ts)):
            for j in range(len(ps)):
                txt = "—" if np.isnan(data[i, j]) else fmt.format(data[i, j])
                bold = (ts[i], ps[j]) == (best.t, best.p)
                dark = not np.isnan(data[i, j]) and (data[i, j] - lo) > 0.6 * (hi - lo)
                ax.text(j, i, txt, ha="center", va="center", fontsize=8, color="white" if bold or dark else "black",
                        fontweight="bold" if bold else "normal",
                        bbox=dict(boxstyle="round", fc="crimson", lw=0) if bold else None)
    fig.suptitle(title, fontsize=11)
    fig.savefig(path, dpi=120)
    plt.close(fig)
