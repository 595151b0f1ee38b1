"""Pipeline schedules as data (pure Python, no torch): actions, schedules, generators, validation."""

from modelpar.schedules.action import Action, Kind
from modelpar.schedules.clock_cycles import clock_cycles
from modelpar.schedules.execute import execute
from modelpar.schedules.generators import (
    SCHEDULES,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    naive,
    one_f_one_b,
    zb_h1,
)
from modelpar.schedules.schedule import Schedule, contiguous_map, loop_map, v_map
from modelpar.schedules.table import schedule_table
from modelpar.schedules.validate import validate_schedule

__all__ = [
    "SCHEDULES",
    "Action",
    "Kind",
    "Schedule",
    "clock_cycles",
    "contiguous_map",
    "execute",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "loop_map",
    "naive",
    "one_f_one_b",
    "schedule_table",
    "v_map",
    "validate_schedule",
    "zb_h1",
]
