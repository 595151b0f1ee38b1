"""Search every layout (t, cp, p, d, micro-batch, v, recomputation, sequence parallelism, ZeRO) and rank them.

A layout is feasible when t divides the heads, the p·v chunks can hold the layers (evenly, or
uneven as ``stages.split_layers`` places them), d·b divides the batch, interleaving has
microbatches divisible by p, and the most loaded device fits in memory (Megatron SC'21 §3,
Korthikanti §4). Feasible ones are ranked by step time; the rest are counted by the reason they were
dropped. Memory never falls as b grows, so that loop stops at the first layout that does not fit.
Context parallelism (cp > 1: the divisors of the GPUs left by t whose 2·cp chunks split the sequence,
``cp_comm`` "ring" unless pinned) is searched when no layout without it fits, or when ``cp`` is
pinned: like ZeRO's higher stages it buys memory (activations ÷ cp) with communication, so it is
worth it for sequences whose activations do not fit otherwise (Megatron-core's advice for CP).
Each axis's values and rule come from ``costmodel.axes``, which ``local_search`` iterates too.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from modelpar.costmodel.assumptions import DEFAULT, Assumptions
from modelpar.costmodel.axes import (
    batch_splits,
    context_splits,
    divisors,
    expert_splits,
    heads_split,
    sequence_parallel_choices,
    shards,
)
from modelpar.costmodel.estimate import Estimate, check_config, estimate_checked
from modelpar.costmodel.memory import memory_breakdown
from modelpar.costmodel.specs import PLANNED_RECOMPUTE, ClusterSpec, ModelSpec, ParallelConfig
from modelpar.costmodel.zero_bytes import ZERO_STAGES

__all__ = ["SearchResult", "chunk_counts", "fitting_gpu_counts", "search"]


@dataclass
class SearchResult:
    """Feasible estimates fastest first, and why the other layouts were dropped."""

    ranked: list[Estimate]
    rejected: Counter = field(default_factory=Counter)  # reason -> number of layouts
    example: dict[str, str] = field(default_factory=dict)  # reason -> one concrete message
    leanest: Estimate | None = None  # least memory among layouts that failed only on memory

    def reject(self, reason: str, message: str, count: int = 1) -> None:
        self.rejected[reason] += count
        self.example.setdefault(reason, message)


def _leanest(model: ModelSpec, t: int, p: int, d: int, batch: int, a: Assumptions) -> float:
    """Bytes per GPU of the least memory-hungry layout with this (t, p, d): b = 1, v = 1, full recompute, SP, ZeRO-3."""
    cfg = ParallelConfig(t, p, d, 1, 1, "full", t > 1, 3 if d > 1 else 0)
    return sum(memory_breakdown(model, cfg, batch // d, a).values())


def fitting_gpu_counts(
    model: ModelSpec, memory_gb: float, batch: int, a: Assumptions = DEFAULT
) -> tuple[list[int], float]:
    """GPU counts t·p·d (t | heads, p ≤ layers + 2, d | batch) whose leanest layout fits ``memory_gb``.

    Also the least GB any layout needs.
    """
    found, least = set(), float("inf")
    for t in (t for t in divisors(model.heads) if heads_split(model, t) is None):
        for p in range(1, model.layers + 3):
            for d in divisors(batch):
                need = _leanest(model, t, p, d, batch, a)
                least = min(least, need)
                if need <= a.memory_limit(memory_gb):
                    found.add(t * p * d)
    return sorted(found), least / 1e9


def _pinned(name: str, value: int | None, options: list[int], res: SearchResult | None = None, of: str = "") -> list[int]:
    """``options``, or just the pinned ``value`` if it is one of them (else record why not)."""
    if value is None:
        return options
    if value not in options and res is not None:
        res.reject("pins", f"{name} = {value} does not divide {of}")
    return [x for x in options if x == value]


def chunk_counts(layers: int, p: int, interleaving: bool = True, even_only: bool = False) -> list[int]:
    """Chunks per device v worth trying: p·v dividing L, or L + 1 or L + 2 (uneven: one or two layers
    fewer on the first and last chunk, which carry the embedding and the output layer, as BLOOM and
    Llama 3 split theirs; not when ``even_only``). v = 1 always; only v = 1 without Megatron's
    interleaved schedule."""
    if not interleaving or p == 1:
        return [1]
    extra = (0,) if even_only else (0, 1, 2)
    return [v for v in range(1, (layers + 2) // p + 1)
            if v == 1 or any((layers + e) % (p * v) == 0 for e in extra)]


def search(
    model: ModelSpec,
    cluster: ClusterSpec,
    batch: int,
    assumptions: Assumptions = DEFAULT,
    *,
    t: int | None = None,
    p: int | None = None,
    d: int | None = None,
    micro_batch: int | None = None,
    v: int | None = None,
    recompute: str | None = None,
    sequence_parallel: bool | None = None,
    zero: int | None = None,
    stage_layers: tuple[int, ...] | None = None,
    cp: int | None = None,
    cp_comm: str = "ring",
    ep: int | None = None,
) -> SearchResult:
    """Estimate every layout of ``model`` on ``cluster`` for global batch ``batch``; pinned arguments fix a dimension.

    ``stage_layers`` pins the layers of each of the p·v chunks (and so p·v). ``cp`` None: cp = 1, and
    every cp whenever no layout at cp = 1 fits. ``ep`` None: for a mixture of experts every ep dividing d and
    the experts (folded into d, as the trainer and Megatron-core do), 1 for a dense model.
    """
    def run(cps: int | None) -> SearchResult:
        return _search(model, cluster, batch, assumptions, t, p, d, micro_batch, v, recompute, sequence_parallel,
                       zero, stage_layers, cps, cp_comm, ep)

    res = run(1 if cp is None else cp)
    if cp is None and not res.ranked:  # nothing fits without context parallelism: split the sequences too
        res = run(None)
    return res


def _search(model: ModelSpec, cluster: ClusterSpec, batch: int, assumptions: Assumptions, t: int | None,
            p: int | None, d: int | None, micro_batch: int | None, v: int | None, recompute: str | None,
            sequence_parallel: bool | None, zero: int | None, stage_layers: tuple[int, ...] | None, cp: int | None,
            cp_comm: str, ep: int | None = None) -> SearchResult:
    """``search`` at ``cp`` (None: every cp whose 2·cp chunks split the sequence)."""
    a, n, res = assumptions, cluster.gpus, SearchResult([])
    recomputes = list(PLANNED_RECOMPUTE) if recompute is None else [recompute]
    for tt in _pinned("t", t, divisors(n), res, f"the {n} GPUs"):
        heads = heads_split(model, tt)
        if heads:
            res.reject("heads", heads)
            continue
        sps = [x for x in sequence_parallel_choices(tt) if sequence_parallel in (None, x)]
        splits = context_splits(n // tt, model.seq)  # 2·cp chunks of s
        cps = _pinned("cp", cp, splits, res, f"the {n // tt} GPUs left by t = {tt} into 2·cp chunks of s = {model.seq}")
        layouts = [(c, q) for c in cps
                   for q in _pinned("p", p, divisors(n // (tt * c)), res, f"the {n // (tt * c)} GPUs left by t·cp = {tt * c}")]
        for cc, pp in layouts:
            dd = n // (tt * cc * pp)
            if d is not None and dd != d:
                res.reject("pins", f"d = {d} but t·cp·p = {tt * cc * pp} leaves d = {dd} on {n} GPUs")
                continue
            if pp > model.layers + 2 or (stage_layers is not None and len(stage_layers) % pp) or (
                    a.uniform_stages and model.layers % pp):  # the reference's model: equal stages only
                res.reject("layers", f"p = {pp} stages cannot hold the {model.layers} layers"
                           + (f" as {len(stage_layers)} chunks" if stage_layers is not None else ""))
                continue
            if batch % dd:
                res.reject("batch", f"d = {dd} does not divide batch ({batch})")
                continue
            if stage_layers is not None:
                chunks = [len(stage_layers) // pp]
            else:
                chunks = [v] if v is not None else chunk_counts(model.layers, pp, a.interleaving, a.uniform_stages)
            # ZeRO-1 is never slower than ZeRO-0 (its optimizer updates a 1/d shard) and holds less: ZeRO-0 only if
            # pinned; over d replicas (not d·cp: at d = 1 a context-parallel layout is not sharded here)
            zeros = [zero] if zero is not None else [z for z in ZERO_STAGES[1:] if shards(z, dd)] or [0]
            experts = expert_splits(model.moe, dd)
            for rc, sp, ee in ((rc, sp, ee) for rc in recomputes for sp in sps
                               for ee in _pinned("ep", ep, experts, res, f"d = {dd} and the experts")):
                for b in _pinned("micro_batch", micro_batch, batch_splits(batch, dd), res, f"batch/d = {batch // dd}"):
                    dims = (tt, pp, dd, b, rc, sp, stage_layers, cc, cp_comm, ee)
                    if _search_chunks(model, cluster, batch, a, res, dims, chunks, zeros):
                        break  # a larger micro-batch needs at least as much memory
    res.ranked.sort(key=lambda e: (e.step_time_s, e.memory_gb))
    return res


def _search_chunks(model: ModelSpec, cluster: ClusterSpec, batch: int, a: Assumptions, res: SearchResult,
                   dims: tuple[int, int, int, int, str, bool, tuple[int, ...] | None, int, str, int], chunks: list[int],
                   zeros: list[int]) -> bool:
    """Try each chunk count v and ZeRO stage for one (t, p, d, b, recompute, sp); True if nothing fit at the first v.

    A ZeRO stage above the first in ``zeros`` is tried only when the one below does not fit: sharding
    more costs traffic, so it is worth it only for memory.
    """
    tt, pp, dd, b, rc, sp, split, cc, comm, ee = dims
    m = batch // (dd * b)
    for vv in chunks:
        if vv > 1 and m % pp:
            res.reject("interleave", f"v = {vv} needs microbatches ({m}) divisible by p = {pp}")
            continue
        reason = check_config(model, cluster, ParallelConfig(tt, pp, dd, b, vv, rc, sp, zeros[0], split, cc, comm, ee),
                              batch, a)
        if reason:  # the same for every ZeRO stage
            res.reject("layers", reason)
            continue
        fitted = False
        for zz in zeros:
            cfg = ParallelConfig(tt, pp, dd, b, vv, rc, sp, zz, split, cc, comm, ee)
            memory = memory_breakdown(model, cfg, m, a)
            need = sum(memory.values())
            if need <= a.memory_limit(cluster.gpu.memory_gb):
                res.ranked.append(estimate_checked(model, cluster, cfg, batch, a, memory))
                fitted = True
                break
            elif not fitted:
                res.reject("memory", f"{_short(cfg)} needs {need / 1e9:.1f} GB > "
                           f"{a.memory_limit(cluster.gpu.memory_gb) / 1e9:.0f} GB")
                if res.leanest is None or need < sum(res.leanest.memory.values()):
                    res.leanest = estimate_checked(model, cluster, cfg, batch, a, memory)
        if not fitted and vv == chunks[0]:
            return True  # the first v holds the fewest microbatches in flight (1F1B's p < p + (p − 1)/v)
    return False


def _short(cfg: ParallelConfig) -> str:
    sp = " sp" if cfg.sequence_parallel else ""
    zero = f" zero{cfg.zero}" if cfg.zero else ""
    cp = f" cp={cfg.cp}" if cfg.cp > 1 else ""
    ep = f" ep={cfg.ep}" if cfg.ep > 1 else ""
    return f"t={cfg.t}{cp} p={cfg.p} d={cfg.d}{ep} b={cfg.micro_batch} v={cfg.v} {cfg.recompute}{sp}{zero}"
