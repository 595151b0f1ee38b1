"""Communication accounting: every tensor-parallel collective records its kind and size.

Tests and examples read the per-layer counts from here (§5.4: 2 all-reduces forward and 2
backward per layer, each of b·s·h elements; §5.6: sequence parallelism turns each into a
reduce-scatter + all-gather of the same volume).

>>> with comm_log() as log:                       # doctest: +SKIP
...     layer(x).sum().backward()
>>> log.count("all_reduce", "forward"), log.numel("all_reduce")
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from modelpar.formulas import allgather_bytes, allreduce_bytes

__all__ = ["CommLog", "CommRecord", "active_logs", "comm_log", "record", "resume_logs"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "shape_check")


@dataclass(frozen=True)
class CommRecord:
    """One collective: ``numel``/``nbytes`` of the full tensor (all-reduce input, all-gather
    output, reduce-scatter input), over a group of ``group_size`` ranks."""

    kind: str  # one of KINDS; "shape_check" is the small metadata all-gather before a heavy one
    phase: str  # "forward", "backward" or "other" (e.g. gathering a state dict)
    numel: int
    nbytes: int
    group_size: int
    op: str = "sum"  # reduction ("sum" or "max"); "" for gathers

    @property
    def sent_bytes(self) -> float:
        """Bytes one rank sends with a ring algorithm: 2(n−1)/n·size for an all-reduce, (n−1)/n·size otherwise."""
        if self.kind == "all_reduce":
            return allreduce_bytes(self.nbytes, self.group_size)
        return allgather_bytes(self.nbytes, self.group_size)


@dataclass
class CommLog:
    """The collectives this process issued while the log was active, in order."""

    records: list[CommRecord] = field(default_factory=list)

    def select(self, kind: str | None = None, phase: str | None = None) -> list[CommRecord]:
        return [r for r in self.records
                if (kind is None or r.kind == kind) and (phase is None or r.phase == phase)]

    def count(self, kind: str | None = None, phase: str | None = None) -> int:
        return len(self.select(kind, phase))

    def numel(self, kind: str | None = None, phase: str | None = None) -> int:
        return sum(r.numel for r in self.select(kind, phase))

    def nbytes(self, kind: str | None = None, phase: str | None = None) -> int:
        return sum(r.nbytes for r in self.select(kind, phase))

    def sent_bytes(self, kind: str | None = None, phase: str | None = None) -> float:
        """Ring-algorithm bytes this rank sent, excluding the small shape checks unless asked."""
        return sum(r.sent_bytes for r in self.select(kind, phase)
                   if kind is not None or r.kind != "shape_check")

    def summary(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(kind, phase) -> (count, total elements)."""
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for r in self.records:
            n, e = out.get((r.kind, r.phase), (0, 0))
            out[(r.kind, r.phase)] = (n + 1, e + r.numel)
        return out


# The logs open in this context (thread / task): a ``with comm_log()`` sees only its own context.
_ACTIVE: ContextVar[tuple[CommLog, ...]] = ContextVar("modelpar_comm_logs", default=())


@contextmanager
def comm_log() -> Iterator[CommLog]:
    """Record every tensor-parallel collective issued inside the ``with`` block (nesting allowed).

    The log is scoped to the block and to this thread: collectives of other threads (another
    pipeline stage's worker) are not in it. A backward run where no log is open goes to the logs
    that were open when its forward ran, so on CUDA, where autograd runs backward on a thread of
    its own, a log around both forward and backward still sees both.
    """
    log = CommLog()
    token = _ACTIVE.set((*_ACTIVE.get(), log))
    try:
        yield log
    finally:
        _ACTIVE.reset(token)


def active_logs() -> tuple[CommLog, ...]:
    """The logs open here; an autograd Function keeps them from its forward for ``resume_logs``."""
    return _ACTIVE.get()


@contextmanager
def resume_logs(logs: tuple[CommLog, ...]) -> Iterator[None]:
    """In a backward: record into ``logs`` (the forward's) if no log is open in this thread."""
    if _ACTIVE.get() or not logs:
        yield
        return
    token = _ACTIVE.set(logs)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def record(kind: str, phase: str, numel: int, itemsize: int, group_size: int, op: str = "sum") -> None:
    """Add one collective to every open log (a no-op when none is open)."""
    logs = _ACTIVE.get()
    if logs:
        rec = CommRecord(kind, phase, int(numel), int(numel) * itemsize, group_size, op)
        for log in logs:
            log.records.append(rec)
