"""Cut a model into a schedule's virtual stages and keep this device's.

Every rank builds the same whole model (same seed) and keeps only its stages, so a bad split
raises the same ValueError on every rank before any communication. With interleaving, device d
keeps virtual stages d, d + K, ... (the schedule's stage -> device map decides).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from modelpar._validate import check_int
from modelpar.layer_split import split_layers
from modelpar.pipeline.partition import split_sequential
from modelpar.recompute.strategies import Strategy
from modelpar.schedules.schedule import Schedule

__all__ = ["split_stages"]


def split_stages(
    model: nn.Sequential,
    schedule: Schedule,
    rank: int,
    balance: Sequence[int] | None = None,
    recompute: Strategy = "none",
) -> dict[int, nn.Module]:
    """``{stage: module}`` for the virtual stages ``schedule`` puts on ``device``.

    ``balance[s]`` is stage s's layer count (default: ``modelpar.layer_split.split_layers``, the
    planner's and the trainer's split). ``recompute`` ("none", k, "sqrt",
    "full", "recompute-all") wraps each stage in ``modelpar.recompute.Recompute``.
    """
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"model must be an nn.Sequential to be split into stages, got {type(model).__name__}")
    n, stages = len(model), schedule.num_stages
    check_int("rank", rank, minimum=0, maximum=schedule.num_ranks - 1)
    if balance is None:
        if n < stages:
            raise ValueError(
                f"model has {n} layers and cannot be split into {stages} stages "
                f"({schedule.num_ranks} devices × {schedule.chunks} chunks); each stage needs a layer"
            )
        balance = split_layers(n, stages)
    elif isinstance(balance, (str, bytes)) or len(balance) != stages:
        raise ValueError(f"balance must give a layer count for each of the {stages} stages, got {balance!r}")
    parts: list[nn.Module] = list(split_sequential(model, balance))
    if recompute is not None and recompute != "none":
        from modelpar.recompute import recompute_stage

        parts = [recompute_stage(p, recompute) for p in parts]
    return {s: parts[s] for s in schedule.stages_on(rank)}
