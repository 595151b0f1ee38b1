"""Text tables of simulated schedules: a metrics table and the bubble-vs-M sweep of §2.3, §4.1–4.2."""

from __future__ import annotations

from collections.abc import Sequence

from modelpar.schedules.registry import check_chunks, get_schedule, schedule_entry, schedule_names
from modelpar.simulate.costs import Costs
from modelpar.simulate.simulator import simulate
from modelpar.simulate.timeline import FORWARD, Timeline

__all__ = ["headline", "label", "metrics_table", "pareto_table", "sweep", "sweep_table", "takes_chunks"]


def label(name: str, chunks: int = 1) -> str:
    """``interleaved (v=2)`` for schedules with a choice of chunks, the plain name otherwise."""
    return f"{name} (v={chunks})" if takes_chunks(name) else name


def takes_chunks(name: str) -> bool:
    """Whether ``name`` is a registered schedule that takes any chunks v (interleaved, looped-bfs)."""
    return name in schedule_names() and schedule_entry(name).chunks is None


def headline(timeline: Timeline) -> str:
    """One line above a chart: name, K, M, step time, bubble, peak held microbatches."""
    peaks = ", ".join(f"{p:g}" for p in timeline.peak_held)
    v = f", v = {timeline.chunks}" if timeline.chunks > 1 else ""
    return (
        f"{timeline.name or 'schedule'} (K = {timeline.num_ranks}, "
        f"M = {timeline.num_microbatches}{v}): step {timeline.format_time(timeline.step_time)}, bubble "
        f"{timeline.bubble:.1%}, peak held microbatches per rank [{peaks}]"
    )


def metrics_table(timelines: Sequence[Timeline]) -> str:
    """One row per timeline: step time, bubble, peak held activations, transfers, speed-up."""
    header = ("schedule", "K", "M", "v", "step", "bubble", "peak held per rank", "transfers", "speed-up")
    rows = [header]
    for t in timelines:
        rows.append((
            label(t.name or "schedule", t.chunks),
            str(t.num_ranks),
            str(t.num_microbatches),
            str(t.chunks),
            f"{t.step_time:.4g}" if t.unit == FORWARD else t.format_time(t.step_time, ".4g"),
            f"{t.bubble:.1%}",
            "[" + ", ".join(f"{p:g}" for p in t.peak_held) + "]",
            str(t.transfers),
            f"{t.speedup:.2f}x",
        ))
    return _format(rows)


def pareto_table(timelines: Sequence[Timeline], front: Sequence[Timeline]) -> str:
    """One row per timeline, by peak: name, peak held (max over ranks), step, bubble; * on the frontier."""
    rows = [("", "schedule", "peak held", "step", "bubble")]
    for t in sorted(timelines, key=lambda t: (max(t.peak_held), t.step_time)):
        rows.append(("*" if any(t is f for f in front) else "", label(t.name or "schedule", t.chunks),
                     f"{max(t.peak_held):g}", f"{t.step_time:.4g}", f"{t.bubble:.1%}"))
    return _format(rows)


def _specs(schedules: Sequence[str | tuple[str, int]], chunks: int) -> list[tuple[str, int]]:
    """Names to (name, v): a bare "interleaved" or "looped-bfs" gets ``chunks``, the others their own."""
    return [
        s if isinstance(s, tuple) else (s, check_chunks(s, chunks if takes_chunks(s) else None)) for s in schedules
    ]


def sweep(
    schedules: Sequence[str | tuple[str, int]],
    ranks: int,
    microbatches: Sequence[int],
    costs: Costs,
    chunks: int = 2,
) -> dict[tuple[str, int, int], float | None]:
    """Bubble (idle / total) at each (name, v, M); None where the schedule does not take that M
    (interleaved: a multiple of K; dualpipe-v: at least 2K)."""
    out: dict[tuple[str, int, int], float | None] = {}
    for name, v in _specs(schedules, chunks):
        for m in microbatches:
            if not schedule_entry(name).microbatches.allows(m, ranks, v):
                out[name, v, m] = None
            else:
                out[name, v, m] = simulate(get_schedule(name, ranks=ranks, microbatches=m, chunks=v), costs).bubble
    return out


def sweep_table(
    schedules: Sequence[str | tuple[str, int]],
    ranks: int,
    microbatches: Sequence[int],
    costs: Sequence[Costs] = (Costs(),),
    chunks: int = 2,
) -> str:
    """Bubble vs M, one block per cost setting (e.g. without / with transfer), one column per schedule."""
    specs = _specs(schedules, chunks)
    blocks = [f"Bubble (idle / total) vs microbatches M, K = {ranks}"]
    for c in costs:
        res = sweep(specs, ranks, microbatches, c)
        rows = [("M",) + tuple(label(n, v) for n, v in specs)]
        for m in microbatches:
            cells = ["-" if res[n, v, m] is None else f"{res[n, v, m]:.1%}" for n, v in specs]
            rows.append((str(m), *cells))
        blocks.append(f"transfer {c.transfer:g} (units of one stage's forward):\n" + _format(rows))
    return "\n".join(blocks)


def _format(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
