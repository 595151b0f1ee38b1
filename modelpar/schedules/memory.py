"""Held activations: how many microbatches' activations a rank keeps at once (pure Python).

The one rule every count reads (simulator, synthesis and ``--memory-limit``, ``auto``, the cost
model, the runtime's ``LocalStage.held``): a forward's activations stay on its stage until the
last action that reads them, from the action table (``kinds.SPECS``): the action that
accumulates the stage's weight gradients (``weight_grads``) — B, or W when the backward is split,
since W's weight GEMMs read the layer inputs the forward saved. What a pending W keeps is
``W_KEEPS`` of the microbatch (whole microbatches here: the runtime's W restarts from the retained
graph, so the whole graph stays until W). Counted in whole-stage microbatches: a chunk of a rank
holding v of them counts 1/v. In bytes, what a stage's microbatches share (views of one tensor: the
runtime's microbatches are slices of the batch) is one allocation, held whole while any of them is held.
"""

from __future__ import annotations

from collections.abc import Sequence

from modelpar.schedules.action import Action, Kind
from modelpar.schedules.kinds import SPECS

__all__ = ["RELEASES", "W_KEEPS", "peak_held", "peak_held_bytes"]

# the kinds after which a stage no longer holds a microbatch's activations: the last to read them
RELEASES = frozenset(k for k, spec in SPECS.items() if spec.weight_grads)
# the share of a microbatch's activations a pending W keeps (I done, W not yet), in the pure count
W_KEEPS = 1.0


def peak_held(actions: Sequence[Sequence[Action]], chunks: int) -> list[float]:
    """Per rank: the most activations held at once (F until B or W), walking its actions in order; a chunk
    counts 1/v (``peak_held_bytes`` with every stage weighing 1, scaled)."""
    stages = 1 + max((a.stage for acts in actions for a in acts), default=0)
    w = 1 / chunks
    return [peak * w for peak in peak_held_bytes(actions, [1.0] * stages)]


def peak_held_bytes(actions: Sequence[Sequence[Action]], stage_bytes: Sequence[float],
                    shared_bytes: Sequence[float] | None = None) -> list[float]:
    """Per rank: the most bytes held at once, a microbatch of stage s weighing ``stage_bytes[s]`` (what
    autograd keeps for it alone: ``costmodel.local_memory.activation_bytes``): F adds it, I frees all but
    ``W_KEEPS`` of it, B or W (``RELEASES``) the rest. ``shared_bytes[s]``: what all of stage s's microbatches
    keep together (the batch tensor their ids or targets are views of: ``costmodel.local_memory.batch_view_bytes``),
    held whole from the first F of s until no microbatch of s is held (its B or W)."""
    f, i, w = Kind.F, Kind.I, Kind.W
    shared = shared_bytes if shared_bytes is not None else [0.0] * len(stage_bytes)
    peaks = []
    for acts in actions:
        held = peak = 0.0
        live = [0] * len(stage_bytes)  # microbatches of each stage held now
        for s, k, _ in acts:
            if k is f:
                held += stage_bytes[s] + (0.0 if live[s] else shared[s])
                live[s] += 1
                peak = max(peak, held)
            elif k is i:
                held -= (1.0 - W_KEEPS) * stage_bytes[s]
            elif k in RELEASES:
                held -= (W_KEEPS if k is w else 1.0) * stage_bytes[s]
                live[s] -= 1
                held -= 0.0 if live[s] else shared[s]
        peaks.append(peak)
    return peaks
