"""One step of a pipeline schedule: run kind F, B, I or W of one (stage, microbatch).

Text form as in torch.distributed.pipelining: ``0F3`` is stage 0, forward, microbatch 3.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    """What an action computes."""

    F = "F"  # forward
    B = "B"  # full backward: input gradient and weight gradient together
    I = "I"  # noqa: E741  backward for the input gradient only (split backward)
    W = "W"  # backward for the weight gradient only (split backward), deferred in zero-bubble

    def __str__(self) -> str:
        return self.value


_ACTION_RE = re.compile(r"^(\d+)([FBIW])(\d+)$")


@dataclass(frozen=True, slots=True, order=True)
class Action:
    """Kind ``kind`` of virtual stage ``stage`` on microbatch ``microbatch``."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the short form ``<stage><F|B|I|W><microbatch>``, e.g. ``2B5``."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(
                f"action must look like <stage><F|B|I|W><microbatch> (e.g. 0F3), got {text!r}"
            )
        return cls(int(match[1]), Kind(match[2]), int(match[3]))


def F(stage: int, microbatch: int) -> Action:  # noqa: N802  (reads like the notation)
    return Action(stage, Kind.F, microbatch)


def B(stage: int, microbatch: int) -> Action:  # noqa: N802
    return Action(stage, Kind.B, microbatch)


def I(stage: int, microbatch: int) -> Action:  # noqa: N802, E743
    return Action(stage, Kind.I, microbatch)


def W(stage: int, microbatch: int) -> Action:  # noqa: N802
    return Action(stage, Kind.W, microbatch)
