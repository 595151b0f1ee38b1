"""The reference's ASCII timeline: one row per rank, one character pair per time unit.

    Device 0 |F0F1F2F3····B0B0F4B1B1|

``F3`` is a forward of microbatch 3, ``B3`` a full backward, ``I3``/``W3`` the two halves of
a split backward, ``··`` idle. A cell is ``unit`` time long; an action of length 2 fills two
cells. With interleaving, odd chunks are drawn in lower case (``f3``, ``b3``). With more than
ten microbatches, cells widen so that every microbatch number fits (``F07``).

Cells are given out along each row in start order: an action covers the cells from its rounded
start to its rounded end, but always at least one, and never one already taken by the action
before it (it starts at the next free cell instead). So every action of non-zero length shows,
even one much shorter than a cell (measured runs); a row squeezed that way runs late by a cell
or so until the next idle gap absorbs it, and the chart widens if it cannot. Timelines whose
times fall on cells (simulated ones with ``auto_unit``) are drawn exactly: one cell per unit.
Zero-length actions take no time and get no cell.
"""

from __future__ import annotations

from modelpar.simulate.timeline import Timeline

__all__ = ["IDLE", "ascii_chart", "auto_unit"]

IDLE = "·"
_UNITS = (1.0, 0.5, 0.25, 0.2, 0.125, 0.1, 0.05)


def auto_unit(timeline: Timeline, max_cells: int = 120) -> float:
    """The coarsest of 1, 1/2, 1/4, 1/5, ... on which every start and end falls exactly."""
    times = [t for row in timeline.starts + timeline.ends for t in row]
    for u in _UNITS:
        if all(abs(t / u - round(t / u)) < 1e-6 for t in times):
            return u
    return max(timeline.step_time / max_cells, 1e-12)


def ascii_chart(timeline: Timeline, unit: float | None = None, label: str = "Device") -> str:
    """Draw ``timeline`` as text; ``unit`` is the time of one cell (default: ``auto_unit``)."""
    u = auto_unit(timeline) if unit is None else unit
    if not u > 0:
        raise ValueError(f"unit must be > 0, got {unit}")
    digits = len(str(max(timeline.num_microbatches - 1, 0)))
    width = 1 + digits
    name_w = len(str(timeline.num_ranks - 1))
    idle = IDLE * width
    rows = []
    for d in range(timeline.num_ranks):
        row: list[str] = []
        for a, s, e in zip(timeline.actions[d], timeline.starts[d], timeline.ends[d]):
            if not e > s:
                continue
            c0 = max(round(s / u), len(row))
            c1 = max(round(e / u), c0 + 1)
            row += [idle] * (c0 - len(row))
            row += [timeline.token(a, digits)] * (c1 - c0)
        rows.append(row)
    n_cells = max([round(timeline.step_time / u), *map(len, rows)])
    return "\n".join(
        f"{label} {d:<{name_w}} |{''.join(row)}{idle * (n_cells - len(row))}|" for d, row in enumerate(rows)
    )
