"""The schedule registry: one entry per named schedule holding every rule that depends on the name (pure Python).

A new schedule is one generator (keyword-only ``ranks=K, microbatches=M``, ``chunks=v`` when it
takes any v, and ``costs=`` — T_F, T_I, T_W of one whole stage — when it plans with the costs: ZB-H2,
V-Half, V-Min) plus one ``register_schedule`` call. The CLI's choices (``modelpar simulate``,
``modelpar train``), the trainer's config checks and default M, the sweep tables, the synthesis's
candidates and the planner read the entry; none of them names a schedule.

    name          v        M                       trains  split backward
    naive         1        any (default 1)         no      no
    gpipe, 1f1b   1        any                     yes     no
    interleaved   any      a multiple of K (v > 1) yes     no
    looped-bfs    any      any                     yes     no
    zb-h1, zb-h2  1        any                     yes     yes
    zb-v, v-half, v-min  2 any                     yes     yes
    dualpipe-v    2        >= 2K                   yes     yes  (F&B pairs overlapped)
    dualpipe-v-serial  2   >= 2K                   yes     yes  (the same order, pairs back to back)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

from modelpar._validate import check_choice, check_int
from modelpar.schedules.generators import (
    INTERLEAVED_MICROBATCHES,
    gpipe,
    interleaved_1f1b,
    looped_bfs,
    naive,
    one_f_one_b,
    zb_h1,
)
from modelpar.schedules.kinds import Kind
from modelpar.schedules.rules import ANY_MICROBATCHES, MicrobatchRule
from modelpar.schedules.schedule import Schedule
from modelpar.schedules.zero_bubble import DUALPIPE_MICROBATCHES, dualpipe_v, v_half, v_min, zb_h2, zb_v

__all__ = ["ScheduleEntry", "check_chunks", "get_schedule", "register_schedule", "schedule_entry", "schedule_names",
           "unregister_schedule"]


@dataclass(frozen=True)
class ScheduleEntry:
    """What the library needs to know about one named schedule besides its actions."""

    build: Callable[..., Schedule]  # ranks=K, microbatches=M (and chunks=v when ``chunks`` is None) -> Schedule
    chunks: int | None = 1  # v stages per rank: 1, or 2 for a V; None: any v (loop placement), 2 unless told
    microbatches: MicrobatchRule = ANY_MICROBATCHES  # which M it takes
    trains: bool = True  # the trainer runs it (naive, M = 1 by design, is the simulator's illustration)
    split_backward: bool = False  # its backward is I then W (the built schedule's ``split_backward``)
    default_microbatches: int = 0  # M when the caller gives none (0: the caller's default; naive: 1)
    takes_costs: bool = False  # its generator plans with ``costs=`` (T_F, T_I, T_W of a whole stage)

    @property
    def default_chunks(self) -> int:
        """The v it runs with unless told: its fixed v, or 2 for a schedule that takes any."""
        return 2 if self.chunks is None else self.chunks


_ENTRIES: dict[str, ScheduleEntry] = {
    "naive": ScheduleEntry(naive, trains=False, default_microbatches=1),
    "gpipe": ScheduleEntry(gpipe),
    "1f1b": ScheduleEntry(one_f_one_b),
    "interleaved": ScheduleEntry(interleaved_1f1b, chunks=None, microbatches=INTERLEAVED_MICROBATCHES),
    "looped-bfs": ScheduleEntry(looped_bfs, chunks=None),
    "zb-h1": ScheduleEntry(zb_h1, split_backward=True),
    "zb-h2": ScheduleEntry(zb_h2, split_backward=True, takes_costs=True),
    "zb-v": ScheduleEntry(zb_v, chunks=2, split_backward=True),
    "v-half": ScheduleEntry(v_half, chunks=2, split_backward=True, takes_costs=True),
    "v-min": ScheduleEntry(v_min, chunks=2, split_backward=True, takes_costs=True),
    "dualpipe-v": ScheduleEntry(dualpipe_v, chunks=2, microbatches=DUALPIPE_MICROBATCHES, split_backward=True),
    "dualpipe-v-serial": ScheduleEntry(partial(dualpipe_v, overlap=False), chunks=2,
                                       microbatches=DUALPIPE_MICROBATCHES, split_backward=True),
}


# The schedules set side by side when nobody names them: the simulator's default comparison and the family the
# local planner searches (its others are reached through ``auto``); 1F1B is what every other is measured against.
COMPARED = ("gpipe", "1f1b", "interleaved", "zb-h1")
BASELINE = "1f1b"


def register_schedule(name: str, entry: ScheduleEntry) -> None:
    """Add schedule ``name`` (ValueError if the name is taken: unregister it first)."""
    if name in _ENTRIES or name == "auto":
        raise ValueError(f"schedule {name!r} is already registered (or reserved)")
    _ENTRIES[name] = entry


def unregister_schedule(name: str) -> None:
    """Remove schedule ``name`` (a test's own, when it is done with it)."""
    check_choice("schedule", name, schedule_names())
    del _ENTRIES[name]


def schedule_names(*, trains: bool | None = None) -> tuple[str, ...]:
    """The registered names in registration order; ``trains=True``: only those the trainer runs."""
    return tuple(name for name, e in _ENTRIES.items() if trains is None or e.trains == trains)


def schedule_entry(name: str) -> ScheduleEntry:
    """The entry of schedule ``name``; ValueError listing the names otherwise."""
    return _ENTRIES[check_choice("schedule", name, schedule_names())]


def any_chunks() -> tuple[str, ...]:
    """The schedules that take a chunks count v (a loop placement); the others have a fixed v."""
    return tuple(name for name, e in _ENTRIES.items() if e.chunks is None)


def check_chunks(name: str, chunks: int | None) -> int:
    """The chunks v schedule ``name`` runs with: ``chunks`` for one that takes any (default 1), its fixed v
    for the others (None or that v); ValueError otherwise."""
    fixed = schedule_entry(name).chunks
    if chunks is None:
        return fixed or 1
    v = check_int("chunks", chunks, minimum=1)
    if fixed is not None and v != fixed:
        why = "a V: two stages per rank" if fixed == 2 else \
            f"only {', '.join(map(repr, any_chunks()))} take a chunks count"
        raise ValueError(f"chunks must be {fixed} for schedule {name!r} ({why}), got {v}")
    return v


def get_schedule(name: str, *, ranks: int, microbatches: int, chunks: int | None = None,
                 costs: Mapping[Kind, float] | None = None) -> Schedule:
    """Build schedule ``name`` (one of ``schedule_names()``) for K pipeline ranks and M microbatches.

    ``chunks`` (v): any for a schedule that takes any (default 1), else its fixed v (``check_chunks``).
    ``costs``: T_F, T_I, T_W of one whole stage, for the schedules that plan with them (the others
    ignore them); None: equal.
    """
    v = check_chunks(name, chunks)
    entry = _ENTRIES[name]
    extra = {"costs": costs} if entry.takes_costs and costs is not None else {}
    if entry.chunks is None:
        return entry.build(ranks=ranks, microbatches=microbatches, chunks=v, **extra)
    return entry.build(ranks=ranks, microbatches=microbatches, **extra)
