"""modelpar: model parallelism in PyTorch, and the tools to reason about it.

The pure-Python parts (``modelpar.schedules``, ``modelpar.simulate``, ``modelpar.costmodel``)
import nothing from torch, so the simulator and the planner start instantly.
"""

__version__ = "0.1.0"
