"""Cost model and 3D-parallel planner (pure Python, no torch).

``formulas`` holds the closed forms the reference text quotes; the specs, estimate and search
build a step-time and memory model from them.
"""

from modelpar.costmodel.formulas import *  # noqa: F401,F403
from modelpar.costmodel.formulas import __all__ as _formulas_all

__all__ = list(_formulas_all)
