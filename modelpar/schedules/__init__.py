"""Pipeline schedules as data (pure Python, no torch): actions, schedules, generators, validation, lowering."""

from modelpar.schedules.action import Action, Kind
from modelpar.schedules.clock_cycles import clock_cycles
from modelpar.schedules.derive import forward_only, on_one_device
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
from modelpar.schedules.lower import Comm, Op, Transfer, lower, parse_op, rendezvous
from modelpar.schedules.schedule import Schedule, contiguous_map, loop_map
from modelpar.schedules.table import schedule_table
from modelpar.schedules.validate import DeadlockError, validate_schedule

__all__ = [
    "SCHEDULES",
    "Action",
    "Comm",
    "DeadlockError",
    "Kind",
    "Op",
    "Schedule",
    "Transfer",
    "clock_cycles",
    "contiguous_map",
    "execute",
    "forward_only",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "loop_map",
    "lower",
    "naive",
    "on_one_device",
    "one_f_one_b",
    "parse_op",
    "rendezvous",
    "schedule_table",
    "validate_schedule",
    "zb_h1",
]
