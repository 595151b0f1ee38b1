"""PNG/SVG timelines via matplotlib: one panel per timeline, one row per rank.

Colour = microbatch; F solid, B hatched ``//``, I hatched ``\\\\``, W hatched ``xx`` and paler;
the grey band behind each row is the step, so what shows through is the bubble. Labels in lower
case are a rank's second chunk (interleaved). A measured timeline with data-parallel
collectives (``Timeline.comm``) gets a thin row under each rank for them, dark where they run
past the rank's last action (exposed), light where they overlap it. Communication inside an action
(``Timeline.inner``: a MoE layer's expert all-to-alls, dispatch and combine) is drawn in the box
itself, a dark violet dotted segment over the box's own colour, with a legend entry. Panels share one time axis, labelled in the
timelines' unit (forward units when simulated, s/ms/µs when measured; mixing them is an error);
each title carries the metrics. matplotlib is imported here only, never by the simulator.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from modelpar.schedules.action import Kind
from modelpar.simulate.tables import label
from modelpar.simulate.timeline import Timeline

__all__ = ["plot_timelines"]

_HATCH = {Kind.F: "", Kind.B: "//", Kind.I: "\\\\", Kind.W: "xx"}
_ALPHA = {Kind.F: 1.0, Kind.B: 0.85, Kind.I: 0.85, Kind.W: 0.55}
_MAX_LABELS = 600  # write "F3" inside bars only when there are few enough to read
_LABEL_INCHES = 0.16  # ... and only in bars at least this wide on the page


def plot_timelines(timelines: Sequence[Timeline], path: str | Path, title: str = "") -> Path:
    """Draw ``timelines`` one above the other and save to ``path`` (.png or .svg); return the path."""
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg"):
        raise ValueError(f"plot path must end in .png or .svg, got {str(path)!r}")
    if not timelines:
        raise ValueError("timelines must not be empty")
    units = sorted({t.unit for t in timelines})
    if len(units) > 1:
        raise ValueError(f"timelines on one time axis must share a unit, got units {units}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = sum(_rows(t) for t in timelines)
    comm = any(_has_comm(t) for t in timelines)
    width = max(11.0 if comm else 8.0, min(18.0, 0.28 * max(_end(t) for t in timelines) + 3))
    fig, axes = plt.subplots(
        len(timelines), 1, figsize=(width, 1.1 + 0.42 * rows + 0.75 * len(timelines)), squeeze=False,
        gridspec_kw={"height_ratios": [_rows(t) for t in timelines]},
    )
    cmap = plt.get_cmap("tab10")
    span = max(_end(t) for t in timelines) or 1.0  # one time axis for all, to compare lengths
    for ax, tl in zip(axes[:, 0], timelines):
        _draw(ax, tl, cmap, span, min_label=_LABEL_INCHES * span / width)
    axes[-1, 0].set_xlabel(f"time ({timelines[0].unit_name})")
    kinds = [k for k in Kind if any(a.kind is k for t in timelines for acts in t.actions for a in acts)]
    handles = [Patch(facecolor="white", edgecolor="black", hatch=_HATCH[k], label=_kind_name(k)) for k in kinds]
    handles.append(Patch(facecolor="#e6e6e6", edgecolor="none", label="idle (bubble)"))
    if any(any(t.inner) for t in timelines):  # a MoE run's all-to-alls
        handles.append(Patch(facecolor=_INNER, edgecolor="white", hatch=_INNER_HATCH,
                             label="MoE all-to-all (dispatch, combine) inside F / B"))
    if comm:
        handles += [Patch(facecolor=_COMM[False], label="dp collective, overlapped"),
                    Patch(facecolor=_COMM[True], label="dp collective, exposed")]
    inner = any(any(t.inner) for t in timelines)  # its long label: one row only if the page is wide enough
    one_row = len(handles) <= 5 and (not inner or sum(0.075 * len(str(h.get_label())) + 0.7 for h in handles) < width)
    ncol = len(handles) if one_row else (len(handles) + 1) // 2
    fig.legend(handles=handles, loc="lower center", ncol=ncol, frameon=False)
    if title:
        fig.suptitle(title)
    legend_in = 0.35 if ncol == len(handles) else 0.6  # the legend's rows, in inches: kept clear of the axis label
    bottom = max(0.06 if ncol == len(handles) else 0.1, legend_in / fig.get_figheight())
    fig.tight_layout(rect=(0, bottom, 1, 0.97 if title else 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_COMM = {False: "#9ecae1", True: "#d62728"}  # overlapped, exposed
_INNER, _INNER_HATCH = "#3d1c5c", "..."  # communication inside an action (expert all-to-alls): dark violet


def _has_comm(tl: Timeline) -> bool:
    return any(tl.comm)


def _end(tl: Timeline) -> float:
    """The last compute action's or collective's end."""
    return max([tl.step_time] + [e for c in tl.comm for _, _, e in c])


def _rows(tl: Timeline) -> float:
    return tl.num_ranks * (1.5 if _has_comm(tl) else 1)


def _draw(ax, tl: Timeline, cmap, span: float, min_label: float) -> None:
    n = tl.num_ranks
    few = sum(len(a) for a in tl.actions) <= _MAX_LABELS
    pitch = 1.5 if _has_comm(tl) else 1.0  # a rank row, and its collectives' row under it
    ticks, names = [], []
    for d in range(n):
        y = (n - 1 - d) * pitch + (pitch - 1)  # rank 0 on top, as in the ASCII chart
        ticks.append(y)
        names.append(f"Device {d}")
        if pitch > 1:
            _draw_comm(ax, tl, d, y - 0.75)
            ticks.append(y - 0.75)
            names.append("dp comm")
        ax.broken_barh([(0, tl.step_time)], (y - 0.4, 0.8), facecolors="#e6e6e6")
        for a, s, e in zip(tl.actions[d], tl.starts[d], tl.ends[d]):
            ax.broken_barh(
                [(s, e - s)], (y - 0.4, 0.8), facecolors=cmap(a.microbatch % 10),
                edgecolors="black", linewidth=0.4, hatch=_HATCH[a.kind], alpha=_ALPHA[a.kind],
            )
            if few and e - s >= min_label:
                ax.text((s + e) / 2, y, tl.token(a), ha="center", va="center", fontsize=7)
        for _, s, e in tl.inner[d]:  # inside the boxes: over the box's middle, so the box's colour shows around it
            ax.broken_barh([(s, e - s)], (y - 0.25, 0.5), facecolors=_INNER, edgecolors="white", linewidth=0.3,
                           hatch=_INNER_HATCH)
    ax.set_yticks(ticks, names)
    ax.set_xlim(0, span)
    ax.set_ylim(-0.6, (n - 1) * pitch + pitch - 1 + 0.6)
    peaks = ", ".join(f"{p:g}" for p in tl.peak_held)
    exposed = f", dp exposed {tl.format_time(max(tl.exposed_comm()), '.3g')}" if pitch > 1 else ""
    ax.set_title(
        f"{label(tl.name or 'timeline', tl.chunks)}  K={n} M={tl.num_microbatches}: step {tl.format_time(tl.step_time, '.4g')}, "
        f"bubble {tl.bubble:.1%}, peak held [{peaks}], {tl.transfers} transfers{exposed}",
        fontsize=10, loc="left",
    )


def _draw_comm(ax, tl: Timeline, d: int, y: float) -> None:
    """Device ``d``'s collectives on a thin row at ``y``: overlapped parts light, the exposed tail dark."""
    last = max(tl.ends[d], default=0.0)
    for _, s, e in tl.comm[d]:
        if s < last:
            ax.broken_barh([(s, min(e, last) - s)], (y - 0.2, 0.4), facecolors=_COMM[False], edgecolors="none")
        if e > last:
            ax.broken_barh([(max(s, last), e - max(s, last))], (y - 0.2, 0.4), facecolors=_COMM[True],
                           edgecolors="none")


def _kind_name(kind: Kind) -> str:
    return {
        Kind.F: "F forward",
        Kind.B: "B backward",
        Kind.I: "I input-grad backward",
        Kind.W: "W weight-grad backward",
    }[kind]


def plot_pareto(named: Sequence[Timeline], synthesised: Sequence[Timeline], front: Sequence[Timeline],
                path: str | Path, title: str = "") -> Path:
    """Step time against peak held activations: one labelled point per named schedule, the
    synthesised ones as squares, the frontier of all as a step line; save to ``path`` (.png or .svg)."""
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg"):
        raise ValueError(f"plot path must end in .png or .svg, got {str(path)!r}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    at: dict[tuple[float, float], list[str]] = {}  # schedules at one point share one label (not drawn over each other)
    for t in named:
        at.setdefault((max(t.peak_held), t.step_time), []).append(label(t.name, t.chunks))
    for (x, y), names in at.items():
        ax.scatter([x], [y], color="#1f77b4", zorder=3)
        below = len(names) > 1  # a stack of names: under the point, clear of its neighbours' labels above
        ax.annotate("\n".join(names), (x, y), textcoords="offset points", xytext=(5, -4 if below else 4), fontsize=8,
                    va="top" if below else "baseline")
    if front:
        pts = sorted((max(t.peak_held), t.step_time) for t in front)
        right = max(max(t.peak_held) for t in (*named, *synthesised, *front))
        pts.append((right, pts[-1][1]))  # more memory buys nothing faster: the frontier runs on to the last point
        ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", color="#888888", zorder=2,
                label="frontier: the fastest within each memory")
    if synthesised:
        pts = sorted((max(t.peak_held), t.step_time) for t in synthesised)
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], color="#d62728", marker="s", s=22, zorder=4,
                   label="auto (synthesised for these costs)")
    ax.legend(loc="upper right", frameon=False)
    unit = (named or synthesised)[0].unit_name
    ax.set_xlabel("peak held activations per rank (microbatches of one stage)")
    ax.set_ylabel(f"step time ({unit})")
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
