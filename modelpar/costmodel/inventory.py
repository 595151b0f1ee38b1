"""The model inventory: every parameter a rank holds (``modelpar train``'s, or Megatron's: the same modules), and its
gradient buckets, from a layout.

One pure function of the layout (``LocalLayout``, or a published run's ``Holding``) that every side reads, so
they cannot drift apart:

- the local pricer prices memory, data-parallel traffic and the optimizer from it (``local_memory``, ``local``);
- the published-run pricer counts a rank's parameters, their gradients and optimizer state from it
  (``memory.device_params``, ``memory_breakdown``, ``estimate``: ``rank_elements``, ``layer_elements``);
- the trainer groups its buckets with ``bucket_groups`` and checks at start that its real modules hold
  these tensors and these buckets (``modelpar.training.parts.check_inventory``).

A parallel dimension's parameter rule (what it splits, what it replicates) is written here once for all three.

Per (virtual) stage, in ``module.parameters()`` order: the first stage's GPT learned positions and its
embedding (vocabulary rows ÷ t); each of the stage's layers (``stage_layers``: ``modelpar.layer_split``, uneven splits
and ``--stage-layers`` included) — norms, attention (fused qkv ÷ t; Llama's q ÷ t and k|v of max(1, kv/t)
heads, replicated beyond t), output projection ÷ t, the MLP ÷ t or a mixture of experts
(``costmodel.moe.moe_layer_tensors``: experts ÷ ep); the last stage's final norm and head (a tied head is the
embedding itself on one stage, a copy of its own across stages). Buckets: the tensors in reverse, those reduced
at once first, then those summed over t first ("partial"), then each tied copy and (ep > 1) expert tensor alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

from modelpar.costmodel.moe import MoESpec, moe_layer_tensors
from modelpar.costmodel.specs import ModelSpec, ParallelConfig
from modelpar.layer_split import layer_ranges, resolve_split

if TYPE_CHECKING:
    from modelpar.costmodel.local_memory import LocalLayout

__all__ = ["Holding", "ParamTensor", "bucket_groups", "bucket_shards", "embedding_elements", "layer_elements",
           "owned_range", "rank_elements", "stage_bucket_list", "stage_bucket_members", "stage_buckets", "stage_layers",
           "stage_tensors", "total_elements", "zero_segments"]


class Holding(NamedTuple):
    """A published run's layout as the inventory reads it (``Holding.of(model, cfg)``): the parameter rules of the
    trainer's modules are Megatron's (vocabulary-parallel embedding and head, column/row-parallel linears,
    replicated norms and row biases, the routed experts whole over t), so the published-run pricer
    (``memory.py``, ``estimate.py``) counts a rank's parameters here too. Only what the count depends on: d and
    cp replicate the parameters (their gradients' ranks are the ``ParallelConfig``'s ``grad_ranks``). A named tuple:
    the planner builds one per layout it prices and looks its counts up in a cache, so it is cheap to build and hash."""

    model: ModelSpec
    t: int
    p: int
    v: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    stage_layers: tuple[int, ...] | None = None

    @classmethod
    def of(cls, model: ModelSpec, cfg: ParallelConfig) -> Holding:
        """What ``cfg`` holds of ``model``: its t, p, v, ep, sequence parallelism and stage split."""
        return cls(model, cfg.t, cfg.p, cfg.v, cfg.ep, cfg.sequence_parallel, cfg.stage_layers)

    @property
    def stages(self) -> int:
        return self.p * self.v

    @property
    def moe(self) -> MoESpec | None:
        """The model's mixture of experts (``LocalLayout`` has the field; here it is the model's)."""
        return self.model.moe


if TYPE_CHECKING:
    Layout: TypeAlias = "LocalLayout | Holding"  # what the inventory reads: a trainer's run or a published one


@dataclass(frozen=True)
class ParamTensor:
    """One parameter on one rank."""

    numel: int
    partial: bool  # its gradient is summed over the tensor-parallel group first (own bucket group)
    tied: bool = False  # a copy of a tied embedding split across stages, or expert weights under ep > 1 (a bucket of its own)
    expert: bool = False  # routed expert weights under ep > 1: reduced and sharded over the d/ep replicas holding them


def stage_layers(run: Layout, stage: int) -> range:
    """Global indices of (virtual) stage ``stage``'s layers: ``run.stage_layers`` or the default split."""
    return layer_ranges(resolve_split(run.model.layers, run.p, run.v, run.stage_layers))[stage]


def _norm(run: Layout, partial: bool) -> list[ParamTensor]:
    h = run.model.hidden
    return [ParamTensor(h, partial)] * (2 if run.model.bias else 1)


def embedding_elements(model: ModelSpec, t: int) -> int:
    """Elements of one rank's share of the word embedding (vocabulary rows ÷ t): the table, its tied copy on the
    last stage, an untied head."""
    return model.vocab // t * model.hidden


def _layer(run: Layout, moe: bool) -> list[ParamTensor]:
    """A layer's parameters on one rank, in the module's order (``moe``: a mixture of experts in place of the MLP)."""
    m, t = run.model, run.t
    h, f, a = m.hidden, m.ffn_size, m.heads
    kv = m.kv_heads or a
    d = h // a
    sp = run.sequence_parallel and t > 1  # replicated parameters see a sequence shard: partial gradients
    bias = m.bias
    out = list(_norm(run, sp))
    if not m.gated_mlp:  # GPT: fused qkv
        out += [ParamTensor(3 * h // t * h, False)] + ([ParamTensor(3 * h // t, False)] if bias else [])
    else:
        kv_replicated = t > kv
        out += [ParamTensor(h // t * h, False), ParamTensor(2 * max(1, kv // t) * d * h, t > 1 and kv_replicated)]
    out += [ParamTensor(h * h // t, False)] + ([ParamTensor(h, sp)] if bias else [])
    out += _norm(run, sp)
    if moe and run.moe is not None:
        e = run.moe
        split = run.ep > 1
        return out + [ParamTensor(n, False, kind == "expert" and split, kind == "expert" and split)
                      for kind, n in moe_layer_tensors(h, e.experts, e.ffn, e.shared, t, run.ep)]
    up = (2 if m.gated_mlp else 1) * f // t
    out += [ParamTensor(up * h, False)] + ([ParamTensor(up, False)] if bias else [])
    out += [ParamTensor(h * f // t, False)] + ([ParamTensor(h, sp)] if bias else [])
    return out


def _first(run: Layout) -> list[ParamTensor]:
    """The first stage's end: the GPT learned positions (the embedding module registers them first) and the word
    embedding (a tied copy of its own on the last stage when there are several)."""
    m = run.model
    out = [ParamTensor(m.seq * m.hidden, run.sequence_parallel and run.t > 1)] if m.learned_positions else []
    return out + [ParamTensor(embedding_elements(m, run.t), False, m.tied_embeddings and run.stages > 1)]


def _last(run: Layout) -> list[ParamTensor]:
    """The last stage's end: the final norm and the head (on one stage a tied head is the embedding itself)."""
    m = run.model
    out = _norm(run, run.sequence_parallel and run.t > 1)
    if not (m.tied_embeddings and run.stages == 1):
        out.append(ParamTensor(embedding_elements(m, run.t), False, m.tied_embeddings and run.stages > 1))
    return out


def _moe_layers(run: Layout) -> frozenset[int]:
    return frozenset(run.moe.layers(run.model.layers)) if run.moe is not None else frozenset()


def stage_tensors(run: Layout, stage: int) -> list[ParamTensor]:
    """The parameters of (virtual) stage ``stage`` on one rank, in ``module.parameters()`` order."""
    moe = _moe_layers(run)
    out = _first(run) if stage == 0 else []
    for i in stage_layers(run, stage):
        out += _layer(run, i in moe)
    return out + (_last(run) if stage == run.stages - 1 else [])


def _elements(tensors: list[ParamTensor]) -> tuple[int, int]:
    """(elements of ``tensors``, of which expert weights reduced over d·cp/ep)."""
    return sum(x.numel for x in tensors), sum(x.numel for x in tensors if x.expert)


@lru_cache(maxsize=4096)
def _layer_elements(run: Holding, moe: bool) -> tuple[int, int]:
    return _elements(_layer(run, moe))


def _one_layer(run: Holding) -> Holding:
    """``run`` with only what a layer's parameters depend on (t, ep, SP, the model): one cache entry for them."""
    return run._replace(p=1, v=1, stage_layers=None)


@lru_cache(maxsize=1 << 16)
def rank_elements(run: Holding, rank: int) -> tuple[int, int]:
    """(parameters, of which routed expert weights under ep > 1, reduced over the d·cp/ep replicas holding them) of
    pipeline rank ``rank``: its stages rank, rank + p, … (Megatron's placement), ``stage_tensors``' count."""
    one, moe = _one_layer(run), _moe_layers(run)
    total = expert = 0
    for stage in range(rank, run.stages, run.p):
        here = stage_layers(run, stage)
        n_moe = sum(1 for i in moe if i in here)
        ends = (_first(run) if stage == 0 else []) + (_last(run) if stage == run.stages - 1 else [])
        for count, (n, e) in ((1, _elements(ends)), (len(here) - n_moe, _layer_elements(one, False)),
                              (n_moe, _layer_elements(one, True) if n_moe else (0, 0))):
            total += count * n
            expert += count * e
    return total, expert


@lru_cache(maxsize=1 << 12)
def total_elements(run: Holding) -> int:
    """Parameters of one model replica's ranks together, ``rank_elements`` summed over the p ranks (a tied
    embedding's copy counted twice, as held)."""
    return sum(rank_elements(run, r)[0] for r in range(run.p))


def layer_elements(run: Holding) -> float:
    """One layer's parameters on a rank, averaged over the model's layers (a ZeRO-3 unit, gathered whole)."""
    one, m = _one_layer(run), run.model
    n_moe = len(_moe_layers(run))
    dense = _layer_elements(one, False)[0] * (m.layers - n_moe)
    return (dense + (_layer_elements(one, True)[0] * n_moe if n_moe else 0)) / m.layers


def bucket_groups(sizes: list[int], elements: int) -> list[range]:
    """Consecutive groups of ``sizes`` of at most ``elements`` elements (a larger tensor alone), as indices: the
    one grouping rule of gradient buckets (``training.buckets.build_buckets`` groups its parameters by it)."""
    groups: list[range] = []
    start = fill = 0
    for i, n in enumerate(sizes):
        if i > start and fill + n > elements:
            groups.append(range(start, i))
            start, fill = i, 0
        fill += n
    if sizes:
        groups.append(range(start, len(sizes)))
    return groups


def stage_bucket_list(run: LocalLayout, stage: int) -> list[tuple[int, int, str]]:
    """(elements, ranks sharing it, ready) of each gradient bucket of ``stage`` (before padding), with when the
    trainer may reduce it (``training.buckets.READY``): "backward" as its gradients are final in the stage's
    last backward, "stage" after that backward's tensor-parallel sum, "step" after the pipeline step. A bucket is
    reduced, and under ZeRO sharded, over the d·cp ranks holding the same parameters; an expert tensor under
    ep > 1 over the d/ep replicas holding the same experts (``GradSync.shard_of``)."""
    return [(sum(sizes), ranks, ready) for sizes, ranks, ready in stage_bucket_members(run, stage)]


def stage_bucket_members(run: LocalLayout, stage: int) -> list[tuple[list[int], int, str]]:
    """``stage_bucket_list`` with each bucket's parameters: (their elements in the bucket's order, ranks, ready)."""
    tensors = stage_tensors(run, stage)
    back = list(reversed(tensors))
    plain = [x.numel for x in back if not x.tied and not x.partial]
    partial = [x.numel for x in back if not x.tied and x.partial]
    ranks = run.grad_ranks
    return ([([plain[i] for i in g], ranks, "backward") for g in bucket_groups(plain, run.bucket_elements)]
            + [([partial[i] for i in g], ranks, "stage") for g in bucket_groups(partial, run.bucket_elements)]
            + [([x.numel], ranks // run.ep if x.expert else ranks, "step") for x in tensors if x.tied])


def zero_segments(run: LocalLayout, stage: int, dp_rank: int) -> int:
    """Under ZeRO, the tensors AdamW steps for ``stage`` on the rank at ``dp_rank`` of the d·cp group: each parameter's
    part inside the rank's range of its bucket (``training.zero.ZeroAdamW``'s segments; buffers padded to a multiple
    of d·cp, an expert bucket's range one of its d/ep replicas', as ``local_memory.state_bytes`` reads them)."""
    count = 0
    for sizes, ranks, _ in stage_bucket_members(run, stage):
        lo, hi = owned_range(run, sum(sizes), ranks, dp_rank)
        offset = 0
        for n in sizes:
            count += max(lo, offset) < min(hi, offset + n)
            offset += n
    return count


def owned_range(run: LocalLayout, elements: int, ranks: int, dp_rank: int) -> tuple[int, int]:
    """[start, stop) of a bucket of ``elements`` shared by ``ranks`` that the rank at ``dp_rank`` of the d·cp group
    owns under ZeRO (``training.buckets.Bucket.shard_range``): the buffer padded to a multiple of d·cp, split in
    ``ranks`` equal ranges; an expert bucket's (``ranks`` = d/ep) indexed among the d/ep replicas holding it."""
    index = dp_rank if ranks == run.grad_ranks else dp_rank // run.ep
    per = -(-elements // run.grad_ranks) * run.grad_ranks // ranks
    return index * per, (index + 1) * per


def bucket_shards(run: LocalLayout, stage: int) -> list[tuple[int, int]]:
    """(elements, ranks sharing it) of each gradient bucket of ``stage``, in ``stage_bucket_list``'s order. Under
    ZeRO every buffer is padded to a multiple of d·cp (a multiple of d/ep too)."""
    return [(n, ranks) for n, ranks, _ in stage_bucket_list(run, stage)]


def stage_buckets(run: LocalLayout, stage: int) -> list[int]:
    """Elements of each gradient bucket of ``stage`` (before padding), in ``stage_bucket_list``'s order."""
    return [n for n, _, _ in stage_bucket_list(run, stage)]
