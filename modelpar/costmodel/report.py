"""Text output of the planner: the ranked table, the paragraph on the winner, and the no-fit errors."""

from __future__ import annotations

from modelpar.costmodel.assumptions import Assumptions
from modelpar.costmodel.estimate import Estimate
from modelpar.costmodel.search import SearchResult, fitting_gpu_counts
from modelpar.costmodel.specs import ClusterSpec, ModelSpec

__all__ = ["best_by_tp", "explain", "format_table", "no_fit_error"]

PARTS = ("compute", "bubble", "tp", "pp", "dp")


def format_table(estimates: list[Estimate]) -> str:
    """One row per estimate: layout, step time, TFLOP/s per GPU, MFU, memory and the step's breakdown in %."""
    head = (f"{'#':>3} {'t':>3} {'p':>4} {'d':>5} {'b':>3} {'v':>3} {'recompute':>9} {'sp':>3} "
            f"{'step s':>9} {'TFLOP/s':>8} {'MFU':>6} {'mem GB':>7} {'bubble':>7} | "
            + " ".join(f"{k:>7}" for k in PARTS))
    lines = [head, "-" * len(head)]
    for i, e in enumerate(estimates, 1):
        c = e.config
        parts = " ".join(f"{100 * e.time[k] / e.step_time_s:6.1f}%" for k in PARTS)
        lines.append(
            f"{i:>3} {c.t:>3} {c.p:>4} {c.d:>5} {c.micro_batch:>3} {c.v:>3} {c.recompute:>9} "
            f"{'on' if c.sequence_parallel else 'off':>3} {e.step_time_s:>9.3f} {e.tflops_per_gpu:>8.1f} "
            f"{e.mfu:>6.1%} {e.memory_gb:>7.1f} {e.bubble:>7.2%} | {parts}"
        )
    return "\n".join(lines)


def _layout(e: Estimate) -> str:
    c = e.config
    sp = " with sequence parallelism" if c.sequence_parallel else ""
    v = f", v = {c.v} chunks per device" if c.v > 1 else ""
    rc = "no" if c.recompute == "none" else c.recompute
    return f"t = {c.t}, p = {c.p}, d = {c.d}, micro-batch {c.micro_batch}{v}, {rc} recomputation{sp}"


def explain(result: SearchResult, cluster: ClusterSpec) -> str:
    """A paragraph on why the winner wins: where its time goes, which links it uses, what it holds."""
    best = result.ranked[0]
    c, share = best.config, {k: best.time[k] / best.step_time_s for k in PARTS}
    text = [f"Best: {_layout(best)}: {best.step_time_s:.3g} s per step, {best.tflops_per_gpu:.0f} TFLOP/s per GPU "
            f"(executed, recomputation included), MFU {best.mfu:.1%}."]
    if c.t > 1:
        where = "inside a node over NVLink" if best.links["tp"] == "nvlink" else "across nodes over the network"
        text.append(f"Tensor parallelism ({c.t}-way) runs its all-reduces {where}: {share['tp']:.1%} of the step.")
    if c.p > 1:
        text.append(f"The {c.p}-stage pipeline with m = {best.microbatches} microbatches has a bubble of "
                    f"(p - 1)/(v*m) = {best.bubble:.1%} of compute ({share['bubble']:.1%} of the step, stage "
                    f"imbalance included); its point-to-point transfers take {share['pp']:.1%}.")
    if c.d > 1:
        text.append(f"The {c.d}-way data-parallel gradient all-reduce ({best.links['dp']}) takes {share['dp']:.1%}.")
    mem = best.memory
    text.append(f"Memory: {best.memory_gb:.1f} of {_gb(best.memory_limit / 1e9)} GB on the most loaded stage "
                f"(training state {mem['state'] / 1e9:.1f} GB, activations "
                f"{(mem['activations'] + mem['working']) / 1e9:.1f} GB).")
    crossing = [e for e in result.ranked if e.config.t > cluster.gpus_per_node]
    if crossing:
        text.append(f"The best layout with t > {cluster.gpus_per_node} (tensor parallelism across nodes) is "
                    f"{crossing[0].step_time_s / best.step_time_s:.2f}x slower.")
    if len(result.ranked) > 1:
        other = result.ranked[1]
        text.append(f"Runner-up: {_layout(other)}, {other.step_time_s / best.step_time_s - 1:+.1%} step time.")
    if result.note:
        text.append(result.note)
    dropped = ", ".join(f"{n} by {k}" for k, n in result.rejected.most_common())
    if dropped:
        text.append(f"Dropped layouts: {dropped}.")
    return " ".join(text)


def _gb(x: float) -> str:
    """80 → "80", 85.899… (80 GiB) → "85.9"."""
    return f"{x:g}" if x == round(x) else f"{x:.1f}"


def best_by_tp(result: SearchResult) -> dict[tuple[int, int], Estimate]:
    """The fastest feasible estimate for each (t, p)."""
    grid: dict[tuple[int, int], Estimate] = {}
    for e in result.ranked:  # ranked fastest first
        grid.setdefault((e.config.t, e.config.p), e)
    return grid


def no_fit_error(model: ModelSpec, cluster: ClusterSpec, batch: int, a: Assumptions, result: SearchResult,
                 pinned: bool) -> ValueError:
    """The one-line error for a search that found nothing: GPU count, memory shortfall or the pins."""
    name, n = model.name, cluster.gpus
    mem = a.memory_limit(cluster.gpu.memory_gb) / 1e9
    counts, least = fitting_gpu_counts(model, mem, batch, a)
    above = [k for k in counts if k >= n]
    hint = (f"; the smallest GPU count that fits is {counts[0]}"
            + (f", the nearest at or above {n} is {above[0]}" if above and above[0] != counts[0] else "")
            if counts else "")
    if result.leanest is not None and not (pinned and result.rejected.keys() - {"memory"}):
        short = result.leanest.memory_gb - mem
        return ValueError(
            f"GPU memory too small: the leanest layout of {name} on {n} GPUs needs "
            f"{result.leanest.memory_gb:.1f} GB per GPU, {short:.1f} GB more than the {_gb(mem)} GB available{hint}"
        )
    if pinned:
        reasons = "; ".join(result.example.values()) or "no layout matches the pinned values"
        return ValueError(f"no layout of {name} on {n} GPUs satisfies the pinned values: {reasons}")
    if not counts:
        return ValueError(f"GPU memory too small: {name} needs at least {least:.1f} GB per GPU at any GPU count "
                          f"(batch {batch}), {least - mem:.1f} GB more than the {_gb(mem)} GB available")
    return ValueError(f"no layout (t | heads, p | layers, d | batch {batch}) splits {name} over {n} GPUs{hint}")
