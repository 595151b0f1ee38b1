"""Text output of the planner: the ranked table, the paragraph on the winner, the accuracy table, the no-fit errors."""

from __future__ import annotations

from collections import defaultdict

from modelpar.costmodel.assumptions import Assumptions
from modelpar.costmodel.engines import ENGINES
from modelpar.costmodel.estimate import PARTS, Estimate
from modelpar.costmodel.published import Validation, mean_abs_error
from modelpar.costmodel.search import SearchResult, fitting_gpu_counts
from modelpar.costmodel.specs import ClusterSpec, ModelSpec

__all__ = ["accuracy_summary", "best_by_tp", "explain", "format_accuracy", "format_table", "no_fit_error"]


def format_table(estimates: list[Estimate]) -> str:
    """One row per estimate: layout, step time, TFLOP/s per GPU, MFU, memory and the step's breakdown in %."""
    head = (f"{'#':>3} {'t':>3} {'cp':>3} {'p':>4} {'d':>5} {'ep':>3} {'b':>3} {'v':>3} {'recompute':>9} {'sp':>3} {'zero':>4} "
            f"{'step s':>9} {'TFLOP/s':>8} {'MFU':>6} {'mem GB':>7} {'bubble':>7} | "
            + " ".join(f"{k[:7]:>7}" for k in PARTS))
    lines = [head, "-" * len(head)]
    for i, e in enumerate(estimates, 1):
        c = e.config
        parts = " ".join(f"{100 * e.time[k] / e.step_time_s:6.1f}%" for k in PARTS)
        lines.append(
            f"{i:>3} {c.t:>3} {c.cp:>3} {c.p:>4} {c.d:>5} {c.ep:>3} {c.micro_batch:>3} {c.v:>3} {c.recompute:>9} "
            f"{'on' if c.sequence_parallel else 'off':>3} {c.zero:>4} {e.step_time_s:>9.3f} {e.tflops_per_gpu:>8.1f} "
            f"{e.mfu:>6.1%} {e.memory_gb:>7.1f} {e.bubble_over_ideal_compute:>7.2%} | {parts}"
        )
    return "\n".join(lines)


def _layout(e: Estimate) -> str:
    c = e.config
    sp = " with sequence parallelism" if c.sequence_parallel else ""
    v = f", v = {c.v} chunks per device" if c.v > 1 else ""
    rc = "no" if c.recompute == "none" else c.recompute
    zero = f", ZeRO-{c.zero}" if c.zero else ""
    cp = f", cp = {c.cp} ({c.cp_comm})" if c.cp > 1 else ""
    ep = f" (ep = {c.ep} inside it)" if c.ep > 1 else ""
    return f"t = {c.t}{cp}, p = {c.p}, d = {c.d}{ep}, micro-batch {c.micro_batch}{v}, {rc} recomputation{sp}{zero}"


def _stages(e: Estimate) -> str:
    """"5/6×10/5" for the layers per device, run-length encoded."""
    runs: list[list[int]] = []
    for n in e.rank_layers:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return "/".join(f"{n}×{k}" if k > 1 else str(n) for n, k in runs)


def explain(result: SearchResult, cluster: ClusterSpec, a: Assumptions) -> str:
    """A paragraph on why the winner wins: the engine assumed, where its time goes, the links, the memory."""
    best = result.ranked[0]
    c, share = best.config, {k: best.time[k] / best.step_time_s for k in PARTS}
    text = [f"Engine: {ENGINES[a.engine].summary}." if a.engine in ENGINES else f"Engine: {a.engine}.",
            f"Best: {_layout(best)}: {best.step_time_s:.3g} s per step, {best.tflops_per_gpu:.0f} TFLOP/s per GPU "
            f"(executed, recomputation included), MFU {best.mfu:.1%}."]
    if c.t > 1:
        where = "inside a node over NVLink" if best.links["tp"] == "nvlink" else "across nodes over the network"
        text.append(f"Tensor parallelism ({c.t}-way) runs its all-reduces {where}: {share['tp']:.1%} of the step.")
    if c.p > 1:
        even = len(set(best.rank_layers)) == 1
        layers = "" if even else f" Its stages are uneven, layers per device {_stages(best)}."
        text.append(f"The {c.p}-stage pipeline with m = {best.microbatches} microbatches has a bubble of "
                    f"(p - 1)/(v*m) = {best.bubble_over_ideal_compute:.1%} of compute ({share['bubble']:.1%} of the "
                    f"step, stage imbalance included); its point-to-point transfers take {share['pp']:.1%}.{layers}")
    if c.d > 1:
        what = ("gradient all-reduce", "gradient reduce-scatter and parameter all-gather (ZeRO-1)",
                "per-microbatch gradient reduce-scatter (ZeRO-2)", "per-layer parameter gathers and gradient "
                "reduce-scatters (ZeRO-3)")[c.zero]
        text.append(f"The {c.d}-way data-parallel {what} ({best.links['dp']}) takes {share['dp']:.1%} exposed.")
    why_ep = _why_ep(result)
    if why_ep:
        text.append(why_ep)
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
    dropped = ", ".join(f"{n} by {k}" for k, n in result.rejected.most_common())
    if dropped:
        text.append(f"Dropped layouts: {dropped}.")
    return " ".join(text)


def _why_ep(result: SearchResult) -> str:
    """Why the winner's expert parallelism: its all-to-all share, and the best layout at every other ep that fits
    (slower, or holding more) — "" for a dense model."""
    best = result.ranked[0]
    per_ep: dict[int, Estimate] = {}
    for e in result.ranked:  # fastest first
        per_ep.setdefault(e.config.ep, e)
    if best.config.ep == 1 and len(per_ep) == 1 and not best.time["ep"]:
        return ""
    c = best.config
    text = (f"Expert parallelism ep = {c.ep} (inside d = {c.d}): each GPU holds 1/{c.ep} of every MoE layer's "
            f"experts" + (f", its all-to-alls ({best.links['ep']}) take {best.time['ep'] / best.step_time_s:.1%} of "
                          "the step" if c.ep > 1 else ", no all-to-all") + ".")
    others = [f"ep = {k}: {e.step_time_s / best.step_time_s - 1:+.1%} step time, {e.memory_gb:.1f} GB"
              for k, e in sorted(per_ep.items()) if k != c.ep]
    if others:
        text += " The best layout at " + "; at ".join(others) + "."
    if 1 not in per_ep:
        text += " No layout at ep = 1 fits."
    return text


def _gb(x: float) -> str:
    """80 → "80", 85.899… (80 GiB) → "85.9"."""
    return f"{x:g}" if x == round(x) else f"{x:.1f}"


def accuracy_summary(rows: list[Validation]) -> dict[str, float]:
    """Mean absolute step-time error per source, over the held-out runs, the fitted ones and all."""
    by_source: dict[str, list[Validation]] = defaultdict(list)
    for r in rows:
        by_source[r.run.source].append(r)
    summary = {source: mean_abs_error(group) for source, group in by_source.items()}
    held = [r for r in rows if not r.run.fitted]
    fitted = [r for r in rows if r.run.fitted]
    if held:
        summary["held out (nothing fitted on them)"] = mean_abs_error(held)
    if fitted:
        summary["fitted"] = mean_abs_error(fitted)
    summary["all"] = mean_abs_error(rows)
    return summary


def format_accuracy(rows: list[Validation]) -> str:
    """The accuracy table: each run's prediction vs its measurement, then the mean absolute errors."""
    unit = {"tflops": "TFLOP/s", "mfu": "MFU", "step_s": "s/step"}

    def show(x: float, convention: str) -> str:
        return f"{x:.1%}" if convention == "mfu" else f"{x:.2f}" if convention == "step_s" else f"{x:.0f}"

    test_set = [r for r in rows if r.run.split == "test"]
    fit_set = [r for r in rows if r.run.split == "fit"]
    worst = lambda group: max(abs(r.error) for r in group)  # noqa: E731
    head = [f"test set (held out, nothing fitted on them): {mean_abs_error(test_set):.1%} mean absolute step-time "
            f"error over {len(test_set)} runs, worst {worst(test_set):.1%}"] if test_set else []
    priced = [r for r in test_set if not r.run.unmodelled]
    if len(priced) < len(test_set):
        head[0] += (f"; {mean_abs_error(priced):.1%} over the {len(priced)} whose features the model prices, worst "
                    f"{worst(priced):.1%} (apart: " + ", ".join(r.run.name for r in test_set if r.run.unmodelled) + ")")
    head += [f"fit set (a parameter was fitted on them): {mean_abs_error(fit_set):.1%} over {len(fit_set)} runs, "
             f"worst {worst(fit_set):.1%}"] if fit_set else []
    lines = head + ([""] if head else []) + [
        f"{'run':<34} {'unit':>7} {'measured':>9} {'predicted':>9} {'error':>7}  {'fit':<3} layout",
             "-" * 100]
    for r in rows:
        c = r.best.config
        layout = (f"t{c.t} p{c.p} d{c.d}{f' ep{c.ep}' if c.ep > 1 else ''} b{c.micro_batch} v{c.v} {c.recompute}"
                  f"{' sp' if c.sequence_parallel else ''}")
        lines.append(f"{r.run.name:<34} {unit[r.run.convention]:>7} {show(r.run.measured, r.run.convention):>9} "
                     f"{show(r.predicted, r.run.convention):>9} {r.error:>+7.1%}  {'*' if r.run.fitted else '':<3} "
                     f"{layout}")
    lines += ["", "error = predicted / measured step time - 1 (+: the model is slower than the run); "
              "* = a parameter was fitted on this run:"]
    for fit in sorted({r.run.fitted for r in rows if r.run.fitted}):
        names = [r.run.name for r in rows if r.run.fitted == fit]
        lines.append(f"  {fit}: {len(names)} runs ({names[0]} ... {names[-1]})")
    lines += ["", "mean absolute error:"]
    lines += [f"  {name:<44} {err:6.1%}" for name, err in accuracy_summary(rows).items()]
    return "\n".join(lines)


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
        what = "layout with the pinned values" if pinned else "layout"
        where = f" ({_layout(result.leanest)})" if pinned else ""
        fits_unpinned = pinned and n in counts
        return ValueError(
            f"GPU memory too small: the leanest {what} of {name} on {n} GPUs{where} needs "
            f"{result.leanest.memory_gb:.1f} GB per GPU, {short:.1f} GB more than the {_gb(mem)} GB available"
            + ("; fewer pins fit" if fits_unpinned else hint)
        )
    if pinned:
        reasons = "; ".join(result.example.values()) or "no layout matches the pinned values"
        return ValueError(f"no layout of {name} on {n} GPUs satisfies the pinned values: {reasons}")
    if not counts:
        return ValueError(f"GPU memory too small: {name} needs at least {least:.1f} GB per GPU at any GPU count "
                          f"(batch {batch}), {least - mem:.1f} GB more than the {_gb(mem)} GB available")
    return ValueError(f"no layout (t | heads, p ≤ layers + 2, d | batch {batch}) splits {name} over {n} GPUs{hint}")
