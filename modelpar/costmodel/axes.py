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
Pure Python.
"""

from __future__ import annotations

from modelpar.costmodel.moe import MoESpec
from modelpar.costmodel.specs import ModelSpec, context_split_reason

__all__ = ["batch_splits", "context_splits", "divisors", "expert_splits", "heads_split",
           "sequence_parallel_choices", "shards"]


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
