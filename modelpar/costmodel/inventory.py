"""The model inventory: every parameter a ``modelpar train`` rank holds, and its gradient buckets, from a layout.

One pure function of the layout (``LocalLayout``) that both sides read, so they cannot drift apart:

- the cost model prices memory, data-parallel traffic and the optimizer from it (``local_memory``, ``local``);
- the trainer groups its buckets with ``bucket_groups`` and checks at start that its real modules hold
  these tensors and these buckets (``modelpar.training.parts.check_inventory``).

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
from typing import TYPE_CHECKING

from modelpar.costmodel.moe import moe_layer_tensors
from modelpar.layer_split import layer_ranges, resolve_split

if TYPE_CHECKING:
    from modelpar.costmodel.local_memory import LocalLayout

__all__ = ["ParamTensor", "bucket_groups", "bucket_shards", "stage_bucket_list", "stage_buckets", "stage_layers",
           "stage_tensors"]


@dataclass(frozen=True)
class ParamTensor:
    """One parameter on one rank."""

    numel: int
    partial: bool  # its gradient is summed over the tensor-parallel group first (own bucket group)
    tied: bool = False  # a copy of a tied embedding split across stages, or expert weights under ep > 1 (a bucket of its own)
    expert: bool = False  # routed expert weights under ep > 1: reduced and sharded over the d/ep replicas holding them


def stage_layers(run: LocalLayout, stage: int) -> range:
    """Global indices of (virtual) stage ``stage``'s layers: ``run.stage_layers`` or the default split."""
    return layer_ranges(resolve_split(run.model.layers, run.p, run.v, run.stage_layers))[stage]


def _norm(run: LocalLayout, partial: bool) -> list[ParamTensor]:
    h = run.model.hidden
    return [ParamTensor(h, partial)] * (2 if run.model.bias else 1)


def _layer(run: LocalLayout, index: int) -> list[ParamTensor]:
    """Layer ``index``'s parameters on one rank, in the module's order."""
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
    if run.moe is not None and index in run.moe.layers(m.layers):
        e = run.moe
        split = run.ep > 1
        return out + [ParamTensor(n, False, kind == "expert" and split, kind == "expert" and split)
                      for kind, n in moe_layer_tensors(h, e.experts, e.ffn, e.shared, t, run.ep)]
    up = (2 if m.gated_mlp else 1) * f // t
    out += [ParamTensor(up * h, False)] + ([ParamTensor(up, False)] if bias else [])
    out += [ParamTensor(h * f // t, False)] + ([ParamTensor(h, sp)] if bias else [])
    return out


def stage_tensors(run: LocalLayout, stage: int) -> list[ParamTensor]:
    """The parameters of (virtual) stage ``stage`` on one rank, in ``module.parameters()`` order."""
    m, t, last = run.model, run.t, run.stages - 1
    split = m.tied_embeddings and run.stages > 1
    sp = run.sequence_parallel and t > 1
    out: list[ParamTensor] = []
    if stage == 0:  # the embedding module registers its positions first
        if m.learned_positions:
            out.append(ParamTensor(m.seq * m.hidden, sp))
        out.append(ParamTensor(m.vocab // t * m.hidden, False, split))
    for i in stage_layers(run, stage):
        out += _layer(run, i)
    if stage == last:
        out += _norm(run, sp)
        if not (m.tied_embeddings and run.stages == 1):  # one stage: the head shares the embedding
            out.append(ParamTensor(m.vocab // t * m.hidden, False, split))
    return out


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


def _sums(sizes: list[int], elements: int) -> list[int]:
    return [sum(sizes[i] for i in g) for g in bucket_groups(sizes, elements)]


def stage_bucket_list(run: LocalLayout, stage: int) -> list[tuple[int, int, str]]:
    """(elements, ranks sharing it, ready) of each gradient bucket of ``stage`` (before padding), with when the
    trainer may reduce it (``training.buckets.READY``): "backward" as its gradients are final in the stage's
    last backward, "stage" after that backward's tensor-parallel sum, "step" after the pipeline step. A bucket is
    reduced, and under ZeRO sharded, over the d·cp ranks holding the same parameters; an expert tensor under
    ep > 1 over the d/ep replicas holding the same experts (``GradSync.shard_of``)."""
    tensors = stage_tensors(run, stage)
    back = list(reversed(tensors))
    plain = [x.numel for x in back if not x.tied and not x.partial]
    partial = [x.numel for x in back if not x.tied and x.partial]
    ranks = run.grad_ranks
    return ([(n, ranks, "backward") for n in _sums(plain, run.bucket_elements)]
            + [(n, ranks, "stage") for n in _sums(partial, run.bucket_elements)]
            + [(x.numel, ranks // run.ep if x.expert else ranks, "step") for x in tensors if x.tied])


def bucket_shards(run: LocalLayout, stage: int) -> list[tuple[int, int]]:
    """(elements, ranks sharing it) of each gradient bucket of ``stage``, in ``stage_bucket_list``'s order. Under
    ZeRO every buffer is padded to a multiple of d·cp (a multiple of d/ep too)."""
    return [(n, ranks) for n, ranks, _ in stage_bucket_list(run, stage)]


def stage_buckets(run: LocalLayout, stage: int) -> list[int]:
    """Elements of each gradient bucket of ``stage`` (before padding), in ``stage_bucket_list``'s order."""
    return [n for n, _, _ in stage_bucket_list(run, stage)]
