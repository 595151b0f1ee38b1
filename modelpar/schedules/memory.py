"""Held activations: how many microbatches' activations a rank keeps at once (pure Python).

A forward leaves its saved graph on the stage until the action that consumes it (``kinds``:
B, or I when split) — the zero-bubble papers' in-flight count; ``until_w`` keeps it until the
stage's last weight-gradient action instead (W when split). Counted in whole-stage microbatches:
a chunk of a rank holding v of them counts 1/v.
"""

from __future__ import annotations

from collections.abc import Sequence

from modelpar.schedules.action import Action, Kind
from modelpar.schedules.kinds import GRAPH, SPECS

__all__ = ["peak_held"]

_FREES = tuple(k for k, spec in SPECS.items() if GRAPH in spec.consumes)
_FREES_AFTER_W = tuple(k for k, spec in SPECS.items() if spec.weight_grads)


def peak_held(actions: Sequence[Sequence[Action]], chunks: int, until_w: bool = False) -> list[float]:
    """Per rank: the most activations held at once, walking its actions in order."""
    w = 1 / chunks
    f, released = Kind.F, frozenset(_FREES_AFTER_W if until_w else _FREES)
    peaks = []
    for acts in actions:
        held = peak = 0
        for _, k, _ in acts:  # Action is a (stage, kind, microbatch) named tuple
            if k is f:
                held += 1
                if held > peak:
                    peak = held
            elif k in released:
                held -= 1
        peaks.append(peak * w)
    return peaks
