"""The step × rank table of a schedule (as torch.distributed.pipelining prints it).

Every action takes one step; a rank's action sits in the first step at which its
dependencies are done, so blank cells are the schedule's bubbles counted in actions.
"""

from __future__ import annotations

from modelpar.schedules.replay import replay_times
from modelpar.schedules.schedule import Schedule

__all__ = ["schedule_table"]


def schedule_table(schedule: Schedule, label: str = "Device") -> str:
    """Rows are steps, columns ranks, cells the ``0F3``-style actions (validates the schedule)."""
    starts, _ = replay_times(schedule)
    steps = 1 + int(max((max(s) for s in starts if s), default=-1))
    grid = [[""] * schedule.num_ranks for _ in range(steps)]
    for d, (acts, times) in enumerate(zip(schedule.actions, starts)):
        for a, t in zip(acts, times):
            grid[int(t)][d] = str(a)
    headers = [f"{label} {d}" for d in range(schedule.num_ranks)]
    width = max(len(h) for h in headers + [c for row in grid for c in row])
    step_w = max(4, len(str(steps - 1)))
    lines = ["Step".rjust(step_w) + "  " + "  ".join(h.ljust(width) for h in headers).rstrip()]
    for i, row in enumerate(grid):
        lines.append(str(i).rjust(step_w) + "  " + "  ".join(c.ljust(width) for c in row).rstrip())
    return "\n".join(lines)
