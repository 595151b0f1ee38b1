"""Schedule validation: complete, ordered on each rank, and free of deadlock (pure Python).

``validate_schedule`` runs the linear-time blocking replay (``replay``); when that fails,
``diagnose`` names the first offending action.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modelpar.schedules.replay import replay_times

if TYPE_CHECKING:  # for annotations only: schedule.py imports this
    from modelpar.schedules.schedule import Schedule

__all__ = ["validate_schedule"]


def validate_schedule(schedule: Schedule) -> None:
    """Raise ValueError naming the first offending action unless ``schedule`` can run to the end."""
    replay_times(schedule)
