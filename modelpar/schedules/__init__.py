"""Pipeline schedules as data (pure Python, no torch): actions, schedules, generators, validation, lowering."""

from modelpar.schedules.action import Action, Kind
from modelpar.schedules.clock_cycles import clock_cycles
from modelpar.schedules.derive import forward_only, on_one_rank
from modelpar.schedules.diagnosis import DeadlockError
from modelpar.schedules.generators import (
    gpipe,
    interleaved_1f1b,
    looped_bfs,
    naive,
    one_f_one_b,
    zb_h1,
)
from modelpar.schedules.greedy import greedy
from modelpar.schedules.lower import Comm, Op, Transfer, lower
from modelpar.schedules.registry import (
    ScheduleEntry,
    get_schedule,
    register_schedule,
    schedule_entry,
    schedule_names,
    unregister_schedule,
)
from modelpar.schedules.replay import replay_times
from modelpar.schedules.schedule import Schedule, contiguous_map, loop_map, v_map
from modelpar.schedules.table import schedule_table
from modelpar.schedules.validate import validate_schedule
from modelpar.schedules.zero_bubble import dualpipe_v, v_half, v_min, zb_h2, zb_v

__all__ = [
    "Action",
    "Comm",
    "DeadlockError",
    "Kind",
    "Op",
    "Schedule",
    "ScheduleEntry",
    "Transfer",
    "clock_cycles",
    "contiguous_map",
    "dualpipe_v",
    "forward_only",
    "get_schedule",
    "gpipe",
    "greedy",
    "interleaved_1f1b",
    "loop_map",
    "looped_bfs",
    "lower",
    "naive",
    "on_one_rank",
    "one_f_one_b",
    "register_schedule",
    "replay_times",
    "schedule_entry",
    "schedule_names",
    "schedule_table",
    "unregister_schedule",
    "v_half",
    "v_map",
    "v_min",
    "validate_schedule",
    "zb_h1",
    "zb_h2",
    "zb_v",
]
