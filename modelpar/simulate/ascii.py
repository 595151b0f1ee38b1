"""The reference's ASCII timeline: one row per device, one character pair per time unit.

    Device 0 |F0F1F2F3····B0B0F4B1B1|

``F3`` is a forward of microbatch 3, ``B3`` a full backward, ``I3``/``W3`` the two halves of
a split backward, ``··`` idle. A cell is ``unit`` time long; an action of length 2 fills two
cells. With interleaving, odd chunks are drawn in lower case (``f3``, ``b3``). With more than
ten microbatches, cells widen so that every microbatch number fits (``F07``).
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
    n_cells = round(timeline.step_time / u)
    name_w = len(str(timeline.num_devices - 1))
    lines = []
    for d in range(timeline.num_devices):
        cells = [IDLE * width] * n_cells
        for a, s, e in zip(timeline.actions[d], timeline.starts[d], timeline.ends[d]):
            token = timeline.token(a, digits)
            c0, c1 = round(s / u), round(e / u)
            for c in range(c0, max(c1, c0 + (e > s))):
                if c < n_cells:
                    cells[c] = token
        lines.append(f"{label} {d:<{name_w}} |{''.join(cells)}|")
    return "\n".join(lines)

