"""Search every 3D layout (t, p, d, micro-batch, v, recomputation, sequence parallelism) and rank them.

A layout is feasible when t divides the heads, p·v the layers, d·b the batch, interleaving has
microbatches divisible by p, and the first stage fits in memory (Megatron SC'21 §3, Korthikanti
§4). Feasible ones are ranked by step time; the rest are counted by the reason they were dropped.
Memory never falls as b or v grows, so those loops stop at the first layout that does not fit.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from modelpar.costmodel.assumptions import DEFAULT, Assumptions
from modelpar.costmodel.estimate import Estimate, estimate
from modelpar.costmodel.memory import memory_breakdown
from modelpar.costmodel.specs import RECOMPUTE, ClusterSpec, ModelSpec, ParallelConfig

__all__ = ["SearchResult", "divisors", "fitting_gpu_counts", "plan", "search"]


def divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order."""
    small = [k for k in range(1, int(n**0.5) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


@dataclass
class SearchResult:
    """Feasible estimates fastest first, and why the other layouts were dropped."""

    ranked: list[Estimate]
    rejected: Counter = field(default_factory=Counter)  # reason -> number of layouts
    example: dict[str, str] = field(default_factory=dict)  # reason -> one concrete message
    leanest: Estimate | None = None  # least memory among layouts that failed only on memory
    note: str = ""  # how the search had to relax its rules, if it did

    def reject(self, reason: str, message: str, count: int = 1) -> None:
        self.rejected[reason] += count
        self.example.setdefault(reason, message)


def _leanest(model: ModelSpec, t: int, p: int, d: int, batch: int, a: Assumptions) -> float:
    """Bytes per GPU of the least memory-hungry layout with this (t, p, d): b = 1, v = 1, full recompute, SP."""
    cfg = ParallelConfig(t, p, d, 1, 1, "full", t > 1)
    return sum(memory_breakdown(model, cfg, batch // d, a).values())


def fitting_gpu_counts(
    model: ModelSpec, memory_gb: float, batch: int, a: Assumptions = DEFAULT
) -> tuple[list[int], float]:
    """GPU counts t·p·d (t | heads, p | layers, d | batch) whose leanest layout fits ``memory_gb``.

    Also the least GB any layout needs.
    """
    kv = model.kv_heads or model.heads
    found, least = set(), float("inf")
    for t in (t for t in divisors(model.heads) if kv % t == 0):
        for p in divisors(model.layers):
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
) -> SearchResult:
    """Estimate every layout of ``model`` on ``cluster`` for global batch ``batch``; pinned arguments fix a dimension."""
    a, n, res = assumptions, cluster.gpus, SearchResult([])
    limit = a.memory_limit(cluster.gpu.memory_gb)
    kv = model.kv_heads or model.heads
    recomputes = list(RECOMPUTE) if recompute is None else [recompute]
    for tt in _pinned("t", t, divisors(n), res, f"the {n} GPUs"):
        if model.heads % tt or kv % tt:
            res.reject("heads", f"t = {tt} does not divide heads ({model.heads}, kv {kv})")
            continue
        sps = [False, True] if tt > 1 else [False]
        sps = sps if sequence_parallel is None else [x for x in sps if x == sequence_parallel]
        for pp in _pinned("p", p, divisors(n // tt), res, f"the {n // tt} GPUs left by t = {tt}"):
            dd = n // (tt * pp)
            if d is not None and dd != d:
                res.reject("pins", f"d = {d} but t·p = {tt * pp} leaves d = {dd} on {n} GPUs")
                continue
            if pp > model.layers or (model.layers % pp and not a.uneven_layers):
                res.reject("layers", f"p = {pp} does not divide layers ({model.layers})")
                continue
            if batch % dd:
                res.reject("batch", f"d = {dd} does not divide batch ({batch})")
                continue
            for rc in recomputes:
                for sp in sps:
                    for b in _pinned("micro_batch", micro_batch, divisors(batch // dd), res, f"batch/d = {batch // dd}"):
                        m = batch // (dd * b)
                        if _search_chunks(model, cluster, batch, a, res, (tt, pp, dd, b, rc, sp), m, v, limit):
                            break  # a larger micro-batch needs at least as much memory
    res.ranked.sort(key=lambda e: (e.step_time_s, e.memory_gb))
    return res


def _search_chunks(model, cluster, batch, a, res, dims, m, v, limit) -> bool:
    """Try each chunk count v for one (t, p, d, b, recompute, sp); True if even v = 1 ran out of memory.

    With uneven stages a chunk may hold only the embedding or the output layer, so p·v ≤ L + 2.
    """
    tt, pp, dd, b, rc, sp = dims
    chunks = range(1, (model.layers + 2) // pp + 1) if a.uneven_layers else divisors(model.layers // pp)
    for vv in _pinned("v", v, list(chunks)):
        if vv > 1 and (pp == 1 or m % pp):
            res.reject("interleave", f"v = {vv} needs p > 1 and microbatches ({m}) divisible by p = {pp}")
            continue
        cfg = ParallelConfig(tt, pp, dd, b, vv, rc, sp)
        mem = sum(memory_breakdown(model, cfg, m, a).values())
        if mem > limit:
            res.reject("memory", f"{_short(cfg)} needs {mem / 1e9:.1f} GB > {limit / 1e9:.0f} GB")
            if res.leanest is None or mem < res.leanest.memory_gb * 1e9:
                res.leanest = estimate(model, cluster, cfg, batch, a)
            if vv == 1 or v is not None or not a.uneven_layers:
                return vv == 1 or v is not None
            continue  # uneven: ⌈L/(p·v)⌉·v is not monotone in v, a larger v may fit
        res.ranked.append(estimate(model, cluster, cfg, batch, a))
    return False


def _short(cfg: ParallelConfig) -> str:
    sp = " sp" if cfg.sequence_parallel else ""
    return f"t={cfg.t} p={cfg.p} d={cfg.d} b={cfg.micro_batch} v={cfg.v} {cfg.recompute}{sp}"


def plan(model: ModelSpec, cluster: ClusterSpec, batch: int, assumptions: Assumptions = DEFAULT, **pins) -> SearchResult:
    """``search``, retried with uneven stages (⌈L/(p·v)⌉ layers on the busiest device) if no even split fits.

    Llama-3 405B's 126 layers, for one, have no power-of-two pipeline split; Megatron-LM and
    DeepSpeed then give some stages fewer layers (Llama 3 paper §3.3.2 does the same).
    """
    res = search(model, cluster, batch, assumptions, **pins)
    if res.ranked or assumptions.uneven_layers or pins.get("p") is not None:  # a pinned p must divide L
        return res
    uneven = search(model, cluster, batch, assumptions.with_(uneven_layers=True), **pins)
    if not uneven.ranked:
        return res
    uneven.note = (f"No layout splits the {model.layers} layers evenly over p·v chunks and fits, so stages are "
                   f"uneven: the busiest device holds ⌈L/(p·v)⌉ layers per chunk, the first and last devices "
                   f"(embedding, output layer) the fewer.")
    return uneven
