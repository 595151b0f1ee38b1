"""``modelpar calibrate``: measure the machine at hand and write its hardware profile (torch side).

``compute`` times GEMMs over a transformer layer's shapes, attention, element-wise work and the
per-op latency; ``comm`` the collectives per group size; ``run`` measures on the processes a
training run would use and builds the ``modelpar.costmodel.profiles.HardwareProfile`` the cost
model reads (``modelpar plan --hardware``, ``modelpar train --hardware``).
"""

from modelpar.calibrate.run import build_profile, calibrate, default_ranks

__all__ = ["build_profile", "calibrate", "default_ranks"]
