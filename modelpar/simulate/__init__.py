"""The schedule simulator (pure Python, no torch): costs -> timeline -> metrics and drawings."""

from modelpar.simulate.closed_form import (
    bubble_fraction_of_step,
    min_microbatches_for_bubble,
    one_f_one_b_bubble_time,
    pipeline_speedup,
    zb_h1_bubble_time,
)
from modelpar.simulate.costs import Costs
from modelpar.simulate.simulator import simulate
from modelpar.simulate.timeline import Event, Timeline

__all__ = [
    "Costs",
    "Event",
    "Timeline",
    "bubble_fraction_of_step",
    "min_microbatches_for_bubble",
    "one_f_one_b_bubble_time",
    "pipeline_speedup",
    "simulate",
    "zb_h1_bubble_time",
]
