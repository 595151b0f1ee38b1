"""A timeline: (rank, action, start, end) events, simulated or measured, and its metrics.

Metrics (all derived, nothing stored twice):
- step time: from the first start to the last end;
- bubble: idle / total, overall (sum over ranks) and per rank;
- peak held activations per rank, in microbatch × whole-stage units (an interleaved chunk is
  1/v of a stage): a microbatch is held from its F until its B (or, split, its W: the pending
  W's weight GEMMs read what the forward saved) — ``schedules.memory``'s rule;
- transfers: cross-rank dependencies (one activation forward, one gradient back per boundary);
- speed-up: the same work done back to back on one rank, divided by the step time;
- exposed communication: per rank, how long its data-parallel collectives (``comm`` spans:
  label, start, end — measured runs only) run past its last compute action, the time the
  optimizer waits for them; the rest of their time overlapped with the pipeline;
- communication inside actions (``inner`` spans: label, start, end — e.g. a MoE layer's expert
  all-to-alls inside its F and B, placed by the cost model that priced them): drawn in the boxes.

Every time is in the timeline's ``unit``: ``"forward"`` (the simulator's: one microbatch's
forward through one whole stage) or a clock unit, ``"s"``, ``"ms"`` or ``"us"``, for measured
runs. The renderers label axes, headlines and traces from it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from functools import cached_property
from typing import NamedTuple

from modelpar._validate import check_choice, check_int
from modelpar.schedules.action import Action
from modelpar.schedules.memory import peak_held
from modelpar.schedules.schedule import Schedule

__all__ = ["FORWARD", "SECONDS_PER_UNIT", "TIME_UNITS", "CommSpan", "Event", "Timeline"]

FORWARD = "forward"  # the simulator's unit: one microbatch's forward through one whole stage
SECONDS_PER_UNIT = {"s": 1.0, "ms": 1e-3, "us": 1e-6}  # clock units of measured timelines
TIME_UNITS = (FORWARD, *SECONDS_PER_UNIT)
_UNIT_NAMES = {FORWARD: "units of one microbatch's forward through one stage", "s": "s", "ms": "ms", "us": "µs"}


class Event(NamedTuple):
    """Rank ``rank`` ran ``action`` from ``start`` to ``end``."""

    rank: int
    action: Action
    start: float
    end: float


class CommSpan(NamedTuple):
    """Rank ``rank`` had collective ``label`` (e.g. "reduce-scatter") in flight from ``start`` to ``end``."""

    rank: int
    label: str
    start: float
    end: float




class Timeline:
    """Actions, starts and ends per rank (aligned lists, times from 0) plus metrics.

    The simulator builds it from columns; ``Timeline.from_events`` builds it from measured or
    hand-made events. ``unit`` says what times are in: ``"forward"`` (simulated, the default)
    or ``"s"``/``"ms"``/``"us"``. ``comm`` holds each rank's data-parallel collectives
    (label, start, end), drawn as a row of their own; ``inner`` the communication inside each rank's
    actions (label, start, end: part of an action's time, not beside it), drawn inside the boxes.
    """

    def __init__(
        self,
        actions: Sequence[Sequence[Action]],
        starts: list[list[float]],
        ends: list[list[float]],
        schedule: Schedule | None = None,
        unit: str = FORWARD,
        comm: Sequence[Sequence[tuple[str, float, float]]] | None = None,
        inner: Sequence[Sequence[tuple[str, float, float]]] | None = None,
    ) -> None:
        check_choice("unit", unit, TIME_UNITS)
        self.actions: list[list[Action]] = [list(a) for a in actions]
        self.starts = starts
        self.ends = ends
        self.schedule = schedule
        self.unit: str = unit
        self.comm: list[list[tuple[str, float, float]]] = ([list(c) for c in comm] if comm is not None
                                                           else [[] for _ in self.actions])
        if len(self.comm) != len(self.actions):
            raise ValueError(f"comm must hold one list per rank ({len(self.actions)}), got {len(self.comm)}")
        self.inner: list[list[tuple[str, float, float]]] = ([list(c) for c in inner] if inner is not None
                                                            else [[] for _ in self.actions])
        if len(self.inner) != len(self.actions):
            raise ValueError(f"inner must hold one list per rank ({len(self.actions)}), got {len(self.inner)}")

    @classmethod
    def from_events(
        cls,
        events: Iterable[Event | tuple],
        num_ranks: int,
        schedule: Schedule | None = None,
        unit: str = FORWARD,
        comm: Iterable[CommSpan | tuple] = (),
    ) -> Timeline:
        """Sort each rank's events (and ``comm`` spans) by start and shift times so that the
        earliest action starts at 0 (measured clocks start anywhere)."""
        d_count = check_int("num_ranks", num_ranks, minimum=1)
        rows: list[list[Event]] = [[] for _ in range(d_count)]
        for raw in events:
            e = Event(*raw)
            if not 0 <= e.rank < d_count:
                raise ValueError(f"event rank must be in 0..{d_count - 1}, got {e.rank} ({e.action})")
            if not e.end >= e.start:
                raise ValueError(f"event end must be >= start, got {e.action} from {e.start} to {e.end}")
            rows[e.rank].append(e)
        spans: list[list[CommSpan]] = [[] for _ in range(d_count)]
        for raw in comm:
            c = CommSpan(*raw)
            if not 0 <= c.rank < d_count or not c.end >= c.start:
                raise ValueError(f"comm span must have a rank in 0..{d_count - 1} and end >= start, got {c}")
            spans[c.rank].append(c)
        rows = [sorted(r, key=lambda e: (e.start, e.end)) for r in rows]
        t0 = min((r[0].start for r in rows if r), default=0.0)
        return cls(
            [[e.action for e in r] for r in rows],
            [[e.start - t0 for e in r] for r in rows],
            [[e.end - t0 for e in r] for r in rows],
            schedule,
            unit,
            [[(c.label, c.start - t0, c.end - t0) for c in sorted(r, key=lambda c: c.start)] for r in spans],
        )

    # --- time unit -----------------------------------------------------------------------------
    @property
    def unit_name(self) -> str:
        """What one time unit is, for axis labels: "units of one microbatch's forward ..." or "ms"."""
        return _UNIT_NAMES[self.unit]

    def format_time(self, t: float, spec: str = "g") -> str:
        """``t`` with its unit: "33 units" (simulated), "12.5 ms" (measured)."""
        return f"{t:{spec}} {'units' if self.unit == FORWARD else _UNIT_NAMES[self.unit]}"

    @property
    def us_per_unit(self) -> float:
        """Microseconds per time unit for traces: exact for clock units; 1 forward drawn as 1 ms."""
        return 1000.0 if self.unit == FORWARD else SECONDS_PER_UNIT[self.unit] * 1e6

    # --- shape ---------------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return len(self.actions)


    @property
    def name(self) -> str:
        return self.schedule.name if self.schedule is not None else ""

    @cached_property
    def stage_to_rank(self) -> tuple[int, ...]:
        if self.schedule is not None:
            return self.schedule.stage_to_rank
        owner = {a.stage: d for d, acts in enumerate(self.actions) for a in acts}
        return tuple(owner.get(s, 0) for s in range(1 + max(owner, default=-1)))

    @property
    def chunks(self) -> int:
        """v: virtual stages per rank (1 unless interleaved)."""
        return max(1, len(self.stage_to_rank) // self.num_ranks)

    @cached_property
    def chunk_of(self) -> list[int]:
        """Stage -> which of its rank's chunks it is (0 for the rank's first stage, 1, ...)."""
        seen: dict[int, int] = {}
        out = []
        for d in self.stage_to_rank:
            out.append(seen.get(d, 0))
            seen[d] = out[-1] + 1
        return out

    def token(self, action: Action, digits: int = 1) -> str:
        """Short label as drawn: ``F3``; lower case (``f3``) for a rank's odd-numbered chunks."""
        letter = action.kind.value if self.chunk_of[action.stage] % 2 == 0 else action.kind.value.lower()
        return f"{letter}{action.microbatch:0{digits}d}"

    @cached_property
    def num_microbatches(self) -> int:
        if self.schedule is not None:
            return self.schedule.num_microbatches
        return 1 + max((a.microbatch for acts in self.actions for a in acts), default=-1)

    @property
    def events(self) -> list[Event]:
        """All events, rank by rank, in start order."""
        return [
            Event(d, a, s, e)
            for d in range(self.num_ranks)
            for a, s, e in zip(self.actions[d], self.starts[d], self.ends[d])
        ]

    # --- metrics -------------------------------------------------------------------------------
    @cached_property
    def step_time(self) -> float:
        return max((max(e) for e in self.ends if e), default=0.0)

    @cached_property
    def busy(self) -> list[float]:
        """Time each rank spends computing."""
        return [sum(e) - sum(s) for s, e in zip(self.starts, self.ends)]

    @property
    def idle(self) -> list[float]:
        """Bubble time of each rank: step time minus busy time."""
        return [self.step_time - b for b in self.busy]

    @property
    def bubble_per_rank(self) -> list[float]:
        """Idle / total for each rank."""
        t = self.step_time
        return [1 - b / t if t else 0.0 for b in self.busy]

    @property
    def bubble(self) -> float:
        """Idle / total over all ranks: 1 - sum(busy) / (ranks × step time)."""
        t = self.step_time
        return 1 - sum(self.busy) / (t * self.num_ranks) if t else 0.0

    @property
    def speedup(self) -> float:
        """Throughput relative to one rank doing all the same work back to back."""
        return sum(self.busy) / self.step_time if self.step_time else 0.0

    @cached_property
    def peak_held(self) -> list[float]:
        """Per rank: the most microbatch × whole-stage activations held (F until B or W)."""
        return peak_held(self.actions, self.chunks)

    @cached_property
    def transfers(self) -> int:
        """Cross-rank dependencies: per crossing boundary, M activations forward, M gradients back."""
        dev = self.stage_to_rank
        crossings = sum(dev[s] != dev[s - 1] for s in range(1, len(dev)))
        return 2 * self.num_microbatches * crossings

    def exposed_comm(self, labels: Collection[str] | None = None) -> list[float]:
        """Per rank: how long its communication spans (those with ``labels``, or all) run past its
        last compute action; 0 without any."""
        return [max([0.0] + [end - (max(e) if e else 0.0) for what, _, end in c if labels is None or what in labels])
                for e, c in zip(self.ends, self.comm)]

    def metrics(self) -> dict[str, object]:
        """The metrics as plain numbers (what ``modelpar simulate --json`` prints)."""
        return {
            "step_time": self.step_time,
            "bubble": self.bubble,
            "bubble_per_rank": self.bubble_per_rank,
            "bubble_per_device": self.bubble_per_rank,  # the same under its old key, which scripts read
            "peak_held": self.peak_held,
            "transfers": self.transfers,
            "speedup": self.speedup,
        }
