"""Pipeline schedules as data (pure Python, no torch)."""

from modelpar.schedules.action import Action, Kind
from modelpar.schedules.clock_cycles import clock_cycles
from modelpar.schedules.schedule import Schedule, contiguous_map, loop_map, v_map

__all__ = ["Action", "Kind", "Schedule", "clock_cycles", "contiguous_map", "loop_map", "v_map"]
