"""Costs of a schedule's actions, in units of one microbatch's forward through one whole stage.

A virtual stage of an interleaved schedule is 1/v of a whole stage, so its actions cost 1/v as
much; ``stage_multipliers`` make stages unbalanced (e.g. the embedding on the first stage).
``forward_comm`` and ``backward_comm`` are the parts of an F's and of a backward's (B, or I: the
backward through the input) time that are communication inside the action, e.g. a MoE layer's
expert all-to-alls: an overlapped F&B pair hides each behind the other half's compute
(``schedules.overlap.pair_time``); actions run alone take their whole time either way.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelpar._validate import check_number
from modelpar.schedules.action import Kind
from modelpar.schedules.kinds import kind_times
from modelpar.schedules.schedule import Schedule

__all__ = ["Costs"]


@dataclass(frozen=True)
class Costs:
    """How long each kind of action takes, and how long a tensor takes to cross ranks."""

    forward: float = 1.0  # T_F: one microbatch through one whole stage (the time unit)
    backward: float | None = None  # full backward B = T_B + T_W; None: backward_ratio × forward
    backward_ratio: float = 2.0  # used when backward is None (the reference's "backward = 2 × forward")
    weight: float | None = None  # T_W, the W part of a split backward; None: half the backward
    transfer: float = 0.0  # one activation or gradient crossing ranks (every cross-rank dependency)
    stage_multipliers: tuple[float, ...] | None = None  # per virtual stage; None: balanced
    forward_comm: float = 0.0  # the part of T_F that is communication inside the forward (MoE all-to-all)
    backward_comm: float = 0.0  # the part of the backward through the input (B, I) that is communication

    def __post_init__(self) -> None:
        check_number("forward", self.forward)
        check_number("backward_ratio", self.backward_ratio, strict=True)  # 0: a backward taking no time
        if self.backward is not None:
            check_number("backward", self.backward)
        if self.weight is not None:
            check_number("weight", self.weight)
            if self.weight > self.full_backward:
                raise ValueError(
                    f"weight (the W part of the backward) must be <= backward ({self.full_backward}), "
                    f"got {self.weight}"
                )
        check_number("transfer", self.transfer)
        for name, x, most in (("forward_comm", self.forward_comm, self.forward),
                              ("backward_comm", self.backward_comm, self.full_backward - self.weight_grad)):
            if check_number(name, x) > most:
                raise ValueError(f"{name} must be <= the action's time ({most}), got {x}")
        if self.stage_multipliers is not None:
            object.__setattr__(self, "stage_multipliers", tuple(self.stage_multipliers))
            for s, x in enumerate(self.stage_multipliers):
                check_number(f"stage_multipliers[{s}]", x)

    @property
    def full_backward(self) -> float:
        """T_B + T_W: the whole backward of one microbatch through one whole stage."""
        return self.backward if self.backward is not None else self.backward_ratio * self.forward

    @property
    def weight_grad(self) -> float:
        """T_W: the weight-gradient part of a split backward."""
        return self.weight if self.weight is not None else self.full_backward / 2

    def durations(self, schedule: Schedule) -> dict[Kind, list[float]]:
        """Time of each kind on each virtual stage: base cost × multiplier / chunks."""
        n = schedule.num_stages
        mult = self.stage_multipliers or (1.0,) * n
        if len(mult) != n:
            raise ValueError(
                f"stage_multipliers must have one entry per stage ({n}), got {len(mult)}"
            )
        base = kind_times(self.forward, self.full_backward, self.weight_grad)
        scale = [x / schedule.chunks for x in mult]
        return {k: [t * x for x in scale] for k, t in base.items()}

    def comm(self, schedule: Schedule) -> dict[Kind, list[float]]:
        """Communication inside each kind of action on each virtual stage, scaled as ``durations``."""
        n = schedule.num_stages
        mult = self.stage_multipliers or (1.0,) * n
        base = {Kind.F: self.forward_comm, Kind.B: self.backward_comm, Kind.I: self.backward_comm, Kind.W: 0.0}
        return {k: [t * x / schedule.chunks for x in mult] for k, t in base.items()}

    def transfer_in(self, schedule: Schedule) -> list[float]:
        """``transfer_in[s]``: time to cross from stage s - 1 to stage s (0 on the same rank)."""
        dev = schedule.stage_to_rank
        return [0.0] + [self.transfer if dev[s] != dev[s - 1] else 0.0 for s in range(1, len(dev))]
