"""The axes of a layout that both planners search, each defined once: the values it takes and the rule that makes
one valid.

``search.py`` (published clusters, ``modelpar plan``) and ``local_search.py`` (``modelpar train --plan auto``)
loop over the same axes in orders of their own and with their own capability lists (what Megatron runs, what
the trainer runs, which ``TrainConfig.check`` has the last word on); the values and the rules come from here:

- t: ``divisors`` of the ranks; a split of the heads when it divides them and the key/value heads (``heads_split``);
- cp: ``context_splits``, the divisors of the ranks t leaves whose 2·cp chunks split a sequence
  (``specs.context_split_reason``, the trainer's and the estimate's rule);
- p: ``divisors`` of the ranks t·cp leaves; d the rest (a divisor of the batch);
- the micro-batch: ``batch_splits``, the divisors of a replica's batch (b sequences, or m = B/(d·b) microbatches);
- ep: ``expert_splits``, the divisors of d that divide the experts (1 for a dense model);
- sequence parallelism: ``sequence_parallel_choices``, only with t > 1;
- ZeRO: ``shards``, a stage above 0 only with more than one rank to shard over.

The chunk counts v are the planners' own (``search.chunk_counts``: Megatron's interleaving, uneven chunks;
``local_search``: the schedule registry's), as are the recomputations (``specs.PLANNED_RECOMPUTE`` for both).

The axes are data, ``AXES``: one ``Axis`` each, its name (the field of ``ParallelConfig`` and ``LocalLayout``
it sets) and its values given the values chosen before it. ``walk`` is the one nested loop both planners
run: a ``Planner`` gives the order (``PUBLISHED`` or ``LOCAL``), what it tries of each axis (pins,
capabilities), which chosen values go on (its rules, its rejection counts), when a loop ends early (pruning)
and the leaf that builds and prices its layout from the chosen values. A new axis is a record here and its
name in the orders. Pure Python.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from modelpar.costmodel.moe import MoESpec
from modelpar.costmodel.specs import CP_COMMS, PLANNED_RECOMPUTE, ModelSpec, context_split_reason
from modelpar.costmodel.zero_bytes import ZERO_STAGES
from modelpar.schedules.registry import COMPARED

__all__ = ["AXES", "LOCAL", "PUBLISHED", "Axis", "Chosen", "Outcome", "Planner", "batch_splits", "context_splits",
           "divisors", "expert_splits", "heads_split", "sequence_parallel_choices", "shards", "walk"]

Chosen = dict[str, Any]  # axis name -> value, and the walk's context: world, batch, seq, moe
Outcome = bool | None  # of a leaf or a loop: a layout fitted (True), none did (False), none was priced (None)


def divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order."""
    small = [k for k in range(1, int(n**0.5) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


def heads_split(model: ModelSpec, t: int) -> str | None:
    """Why t-way tensor parallelism cannot split ``model``'s attention (t must divide the heads and the key/value
    heads), or None."""
    kv = model.kv_heads or model.heads
    if model.heads % t or kv % t:
        return f"t = {t} does not divide heads ({model.heads}, kv {kv})"
    return None


def context_splits(ranks: int, seq: int) -> list[int]:
    """The cp to try on ``ranks`` ranks: 1, and each divisor whose 2·cp chunks split a sequence of ``seq`` tokens."""
    return [c for c in divisors(ranks) if context_split_reason(seq, c) is None]


def batch_splits(batch: int, d: int) -> list[int]:
    """The ways a replica's batch (``batch`` / d sequences) splits: the micro-batch sizes b, or the microbatch
    counts m = B/(d·b), in increasing order."""
    return divisors(batch // d)


def expert_splits(moe: MoESpec | None, d: int) -> list[int]:
    """The ep to try at d replicas (ep folds into d): the divisors of d that divide the experts; 1 for a dense model."""
    return [e for e in divisors(d) if moe.experts % e == 0] if moe is not None else [1]


def sequence_parallel_choices(t: int) -> tuple[bool, ...]:
    """Sequence parallelism to try: off, and on when there is a tensor-parallel group (t > 1) to split over."""
    return (False, True) if t > 1 else (False,)


def shards(zero: int, ranks: int) -> bool:
    """Whether ZeRO stage ``zero`` is worth a layout whose state is shared by ``ranks`` ranks: stage 0 always, a
    sharding stage only over more than one."""
    return zero == 0 or ranks > 1


@dataclass(frozen=True)
class Axis:
    """One axis of a layout: its name (the layout field it sets) and its values given those chosen before it."""

    name: str
    values: Callable[[Chosen], Sequence[Any]]


AXES: dict[str, Axis] = {axis.name: axis for axis in (
    Axis("t", lambda c: divisors(c["world"])),
    Axis("cp", lambda c: context_splits(c["world"] // c["t"], c["seq"])),
    Axis("cp_comm", lambda c: ("ring",) if c["cp"] == 1 else CP_COMMS),
    Axis("p", lambda c: divisors(c["world"] // (c["t"] * c["cp"]))),
    Axis("d", lambda c: (c["world"] // (c["t"] * c["cp"] * c["p"]),)),
    Axis("schedule", lambda c: COMPARED),
    Axis("v", lambda c: (1,)),
    Axis("micro_batch", lambda c: batch_splits(c["batch"], c["d"])),
    Axis("microbatches", lambda c: batch_splits(c["batch"], c["d"])),
    Axis("recompute", lambda c: PLANNED_RECOMPUTE),
    Axis("sequence_parallel", lambda c: sequence_parallel_choices(c["t"])),
    Axis("ep", lambda c: expert_splits(c["moe"], c["d"])),
    Axis("zero", lambda c: [z for z in ZERO_STAGES if shards(z, c["d"] * c["cp"])]),
)}

# The orders the planners walk: Megatron's (micro-batch, v and ZeRO last, for its pruning), the trainer's.
PUBLISHED = ("t", "cp", "cp_comm", "p", "d", "recompute", "sequence_parallel", "ep", "micro_batch", "v", "zero")
LOCAL = ("t", "cp", "cp_comm", "p", "d", "schedule", "v", "microbatches", "recompute", "sequence_parallel", "zero", "ep")


class Planner(ABC):
    """The hooks of one walk; the defaults try every value of every axis and end no loop early. A planner is its
    ``order`` and its ``leaf`` at least."""

    order: tuple[str, ...] = ()

    def options(self, axis: Axis, chosen: Chosen) -> Sequence[Any]:
        """The values of ``axis`` to try (a pin or a capability narrows the axis's own)."""
        return axis.values(chosen)

    def valid(self, name: str, chosen: Chosen) -> bool:
        """Whether the value just chosen for ``name`` goes on (a rule; count the rejection if not)."""
        return True

    def ends(self, name: str, index: int, outcome: Outcome) -> str | None:
        """The loop that ``outcome`` of value number ``index`` of ``name`` ends: ``name``'s, an outer one's, or none."""
        return None

    @abstractmethod
    def leaf(self, chosen: Chosen) -> Outcome:
        """Build (and price) the layout of the chosen values."""


def walk(planner: Planner, chosen: Chosen, depth: int = 0) -> tuple[Outcome, str | None]:
    """Try every value of ``planner.order[depth:]`` after ``chosen`` (filled in place); the outcome (True if any
    layout fitted, False if one was priced and none fitted, None if none was priced) and the outer loop to end."""
    name, last = planner.order[depth], depth + 1 == len(planner.order)
    outcome: Outcome = None
    for index, value in enumerate(planner.options(AXES[name], chosen)):
        chosen[name] = value
        if not planner.valid(name, chosen):
            continue
        got, end = (planner.leaf(chosen), None) if last else walk(planner, chosen, depth + 1)
        outcome = True if got or outcome else False if got is False or outcome is False else None
        end = end or planner.ends(name, index, got)
        if end == name:
            break
        if end is not None:
            return outcome, end
    return outcome, None
