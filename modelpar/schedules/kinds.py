"""What each action kind consumes, produces and sends: the one table every pass derives from.

An action (kind, stage s, microbatch m) consumes and produces *values* of (s, m). A value is
used by one stage (``consumer`` steps away from its producer): the forward's output by stage
s + 1 and the input gradient by stage s − 1 (a message when that stage sits on another rank,
a hand-over in memory otherwise); the saved graph and the deferred weight gradient by s itself.
Beyond the ends of the model a value comes from the batch or the loss, or is dropped::

    kind  consumes                       produces                    meaning                   pair half
    F     ACT(s − 1)   [s = 0: batch]    ACT(s) [last: loss], GRAPH  forward                   1
    B     GRAPH(s), GRAD(s + 1) [last: loss]  GRAD(s) [s = 0: none]  full backward             2
    I     GRAPH(s), GRAD(s + 1)          GRAD(s), DEFERRED           input-gradient backward   2
    W     DEFERRED(s)                    —                           weight-gradient backward  —

The last column says which half of an overlapped pair (DualPipe's F&B, ``schedules.overlap``)
a kind may be: a forward first, a backward through the input (B or I) second; W is never paired.

Validation, timing (``replay``), lowering, the rendezvous model and the runtime's plan read
this table; adding a kind means adding a ``Kind`` member and its ``SPECS`` row. A schedule uses
one *style* (``STYLES``): the kinds that together produce each value it consumes exactly once.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

__all__ = ["ACT", "DEFERRED", "GRAD", "GRAPH", "KINDS", "SPECS", "STYLES", "VALUES", "Kind", "KindSpec", "Value",
           "describe_message", "inputs_of", "producers", "style_of"]


class Kind(str, Enum):
    """What an action computes."""

    F = "F"  # forward
    B = "B"  # full backward: input gradient and weight gradient together
    I = "I"  # backward for the input gradient only (split backward), on the critical path
    W = "W"  # backward for the weight gradient only (split backward), deferred in zero-bubble

    def __str__(self) -> str:
        return self.value


class Value(NamedTuple):
    """A kind of tensor an action leaves for another: who uses it, and how it travels."""

    name: str
    consumer: int  # the using stage minus the producing one: +1, -1, or 0 (stays on its stage)
    message: str  # the letter of its SEND_x / RECV_x when it crosses ranks ("" if it never does)
    noun: str  # in words, for messages: "activation", "gradient"
    boundary_in: str  # where a consumer past the model's end gets it instead: "input" (batch), "" (loss)
    boundary_out: str  # where the producer at the model's end puts it instead: "loss", "" (dropped)


ACT = Value("activation", +1, "F", "activation", "input", "loss")
GRAD = Value("input gradient", -1, "B", "gradient", "", "")
GRAPH = Value("saved graph", 0, "", "saved forward graph", "", "")
DEFERRED = Value("deferred weight gradient", 0, "", "deferred weight gradient", "", "")
VALUES = (ACT, GRAD, GRAPH, DEFERRED)


class KindSpec(NamedTuple):
    """One row of the table."""

    consumes: tuple[Value, ...]  # in the order they are awaited
    produces: tuple[Value, ...]
    describe: str  # "a forward F", for error messages
    weight_grads: bool  # accumulates weight gradients (the last action touching a stage's weights)
    half: int = 0  # in an overlapped pair: 1 the first half (a forward), 2 the second (a backward), 0 never


SPECS: dict[Kind, KindSpec] = {
    Kind.F: KindSpec((ACT,), (ACT, GRAPH), "a forward F", False, 1),
    Kind.B: KindSpec((GRAPH, GRAD), (GRAD,), "a full backward B", True, 2),
    Kind.I: KindSpec((GRAPH, GRAD), (GRAD, DEFERRED), "an input-gradient backward I", False, 2),
    Kind.W: KindSpec((DEFERRED,), (), "a weight-gradient backward W", True),
}
KINDS = tuple(SPECS)

# the styles a schedule may use, smallest first: forward only (evaluation), full backward, split backward
STYLES: tuple[tuple[Kind, ...], ...] = ((Kind.F,), (Kind.F, Kind.B), (Kind.F, Kind.I, Kind.W))


def kind_times(forward: float, backward: float, weight: float) -> dict[Kind, float]:
    """Each kind's time from T_F, the full backward's T_B and its weight-gradient part T_W: I = B − W
    (a split backward does the full one's work in two actions)."""
    return {Kind.F: forward, Kind.B: backward, Kind.I: backward - weight, Kind.W: weight}


def inputs_of(kind: Kind, stage: int) -> list[tuple[Value, int]]:
    """(value, the stage that produced it) for each value ``kind`` at ``stage`` consumes, in order."""
    return [(v, stage - v.consumer) for v in SPECS[kind].consumes]


def style_of(kinds: set[Kind]) -> tuple[Kind, ...] | None:
    """The smallest style holding every kind in ``kinds``; None if none does (e.g. B mixed with I)."""
    return next((style for style in STYLES if kinds <= set(style)), None)


def producers(style: tuple[Kind, ...]) -> dict[Value, Kind]:
    """Which kind of ``style`` produces each value (one per value: that is what makes it a style)."""
    out: dict[Value, Kind] = {}
    for kind in style:
        for v in SPECS[kind].produces:
            out.setdefault(v, kind)
    return out


def describe_message(message: tuple[str, int, int]) -> str:
    """``("F", 2, 5)`` -> "the activation of microbatch 5 from stage 2"."""
    letter, stage, microbatch = message
    value = next(v for v in VALUES if v.message == letter)
    return f"the {value.noun} of microbatch {microbatch} from stage {stage}"


def _check_table() -> None:
    """Every style gives each value it consumes exactly one producer (checked at import)."""
    for style in STYLES:
        made = [v for k in style for v in SPECS[k].produces]
        for k in style:
            for v in SPECS[k].consumes:
                if made.count(v) != 1:
                    raise RuntimeError(f"style {style}: {v.name} (consumed by {k}) has {made.count(v)} producers")


_check_table()
