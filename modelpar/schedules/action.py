"""One step of a pipeline schedule: run kind F, B, I or W of one (stage, microbatch).

Text form as in torch.distributed.pipelining: ``0F3`` is stage 0, forward, microbatch 3.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from modelpar.schedules.kinds import KINDS, Kind

__all__ = ["Action", "B", "F", "I", "Kind", "W"]

_LETTERS = "|".join(k.value for k in KINDS)
_ACTION_RE = re.compile(rf"^(\d+)({_LETTERS})(\d+)$")


class Action(NamedTuple):
    """Kind ``kind`` of virtual stage ``stage`` on microbatch ``microbatch``.

    A named tuple (immutable, hashable, ordered by stage, kind, microbatch): a schedule holds
    half a million of them at K=64, M=1024, v=4, and one is created in 60% of a frozen slots
    dataclass's time. Being a tuple, it equals ``(stage, kind, microbatch)`` and unpacks as one.
    """

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
            raise ValueError(f"action must look like <stage><{_LETTERS}><microbatch> (e.g. 0F3), got {text!r}")
        return cls(int(match[1]), Kind(match[2]), int(match[3]))


def F(stage: int, microbatch: int) -> Action:
    return Action(stage, Kind.F, microbatch)


def B(stage: int, microbatch: int) -> Action:
    return Action(stage, Kind.B, microbatch)


def I(stage: int, microbatch: int) -> Action:  # noqa: E743
    return Action(stage, Kind.I, microbatch)


def W(stage: int, microbatch: int) -> Action:
    return Action(stage, Kind.W, microbatch)
