"""Test-only faults, each switched on by an environment variable and absent otherwise.

The stopping tests need a NaN gradient at a chosen step and rank, and a model initialisation long
enough to interrupt. Production steps run none of this: ``nonfinite_hook`` is None unless
``MODELPAR_TEST_NONFINITE`` is set, and the loop calls the hook only when there is one.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["INJECT_NONFINITE", "SLOW_INIT", "nonfinite_hook", "slow_init"]

# "k" or "k:r" makes rank r (default 0) see a NaN gradient in step k (1-based).
INJECT_NONFINITE = "MODELPAR_TEST_NONFINITE"
# Seconds every rank spends more building its model (a long initialisation to interrupt).
SLOW_INIT = "MODELPAR_TEST_SLOW_INIT"

GradHook = Callable[[int, list[torch.nn.Parameter]], None]


def nonfinite_hook() -> GradHook | None:
    """With ``MODELPAR_TEST_NONFINITE`` = "k[:r]": a hook ``(step, params)`` that puts a NaN in rank r's
    first gradient in step k (``step`` is 0-based, k 1-based); without it, None."""
    text = os.environ.get(INJECT_NONFINITE, "")
    if not text:
        return None
    at, _, rank = text.partition(":")
    target = (int(at), int(rank or 0))

    def inject(step: int, params: list[torch.nn.Parameter]) -> None:
        if target == (step + 1, dist.get_rank()) and params and params[0].grad is not None:
            params[0].grad.view(-1)[0] = math.nan

    return inject


def slow_init() -> None:
    """With ``MODELPAR_TEST_SLOW_INIT``: sleep that many seconds, as a long model initialisation would take."""
    seconds = float(os.environ.get(SLOW_INIT, "") or 0)
    if seconds > 0:
        time.sleep(seconds)
