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
The axes, their values and the one loop over them (``axes.walk``, in the order ``axes.PUBLISHED``) are
``costmodel.axes``', which ``local_search`` walks too; this file's are the hooks (``_Published``): the pins, the
rules above with their reasons, the prunings and the leaf that prices a ``ParallelConfig`` of the chosen values.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from modelpar.costmodel.assumptions import DEFAULT, Assumptions
from modelpar.costmodel.axes import PUBLISHED, Axis, Chosen, Outcome, Planner, divisors, heads_split, shards, walk
from modelpar.costmodel.estimate import Estimate, check_config, estimate_checked
from modelpar.costmodel.memory import memory_breakdown
from modelpar.costmodel.specs import ClusterSpec, ModelSpec, ParallelConfig
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
    pins = {"t": t, "p": p, "d": d, "micro_batch": micro_batch, "v": v, "recompute": recompute,
            "sequence_parallel": sequence_parallel, "zero": zero, "cp": cp, "cp_comm": cp_comm, "ep": ep}
    walker = _Published(model, cluster, batch, assumptions, pins, stage_layers)
    walk(walker, {"world": cluster.gpus, "batch": batch, "seq": model.seq, "moe": model.moe})
    walker.res.ranked.sort(key=lambda e: (e.step_time_s, e.memory_gb))
    return walker.res


_REFUSED = ("t", "ep", "micro_batch")  # besides cp and p: pins that are refused with a reason when not a value


class _Published(Planner):
    """Megatron's walk of the axes: pins refused with a reason, rules counted by reason, and its pruning: a micro-batch
    that does not fit at the first v ends the b loop (a larger one needs at least as much memory), a ZeRO stage above
    the first tried only when the one below does not fit (sharding more costs traffic: worth it only for memory)."""

    order = PUBLISHED

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, batch: int, a: Assumptions, pins: dict[str, Any],
                 stage_layers: tuple[int, ...] | None) -> None:
        self.model, self.cluster, self.batch, self.a, self.pins = model, cluster, batch, a, pins
        self.split, self.res = stage_layers, SearchResult([])
        self.limit = a.memory_limit(cluster.gpu.memory_gb)
        self._stages: dict[int, list[int]] = {}  # cp -> the p to try at the current t
        self._zeros: dict[int, list[int]] = {}  # d -> the ZeRO stages to try
        self._v: dict[int, list[int]] = {}  # p -> the v to try
        self._fields = tuple(n for n in self.order if n != "zero")
        self._checked: ParallelConfig | None = None  # the layout ``check_config`` saw at the current v

    def options(self, axis: Axis, c: Chosen) -> Sequence[Any]:
        """The axis's values, or its pin: t, cp, p, ep and b refuse a pin that is not among them."""
        name = axis.name
        if name == "zero":
            return self._zero(c["d"])
        if name == "v":
            return self._chunks(c["p"])
        if name == "p":
            return self._stages[c["cp"]]
        pin = self.pins.get(name)
        if pin is not None and name in ("recompute", "cp_comm"):
            return [pin]
        values = axis.values(c)
        if name == "sequence_parallel":
            kept = [x for x in values if pin in (None, x)]
            if not kept:  # pinned on at t = 1: nothing to split over (said, as other pins are)
                self.res.reject("pins", f"sequence parallelism needs t > 1 to split over, got t = {c['t']}")
            return kept
        if name == "cp":
            return self._contexts(_pinned("cp", pin, list(values), self.res, self._of("cp", c)), c["t"])
        return _pinned(name, pin, list(values), self.res, self._of(name, c)) if name in _REFUSED else values

    def _contexts(self, cps: list[int], t: int) -> list[int]:
        """``cps``, having found the p to try at each (a refused p pin counted for every cp before any d is tried)."""
        n = self.cluster.gpus
        self._stages = {cp: _pinned("p", self.pins["p"], divisors(n // (t * cp)), self.res,
                                    f"the {n // (t * cp)} GPUs left by t·cp = {t * cp}") for cp in cps}
        return cps

    def _of(self, name: str, c: Chosen) -> str:
        """What a refused pin of ``name`` does not divide."""
        if name == "t":
            return f"the {self.cluster.gpus} GPUs"
        if name == "cp":
            return f"the {self.cluster.gpus // c['t']} GPUs left by t = {c['t']} into 2·cp chunks of s = {self.model.seq}"
        return f"d = {c['d']} and the experts" if name == "ep" else f"batch/d = {self.batch // c['d']}"

    def _zero(self, d: int) -> list[int]:
        """The ZeRO stages to try at d: ZeRO-1 is never slower than ZeRO-0 and holds less, so ZeRO-0 only if pinned
        (or at d = 1); sharded over d, not d·cp (at d = 1 a context-parallel layout is not sharded here)."""
        if d not in self._zeros:
            pin = self.pins["zero"]
            self._zeros[d] = [pin] if pin is not None else [z for z in ZERO_STAGES[1:] if shards(z, d)] or [0]
        return self._zeros[d]

    def _chunks(self, p: int) -> list[int]:
        """The v to try at ``p``: pinned by ``stage_layers`` or ``v``, else ``chunk_counts``."""
        if p not in self._v:
            pin, a = self.pins["v"], self.a
            self._v[p] = ([len(self.split) // p] if self.split is not None else [pin] if pin is not None
                          else chunk_counts(self.model.layers, p, a.interleaving, a.uniform_stages))
        return self._v[p]

    def valid(self, name: str, c: Chosen) -> bool:
        """Megatron's rules: heads at t; the d pin, the layers and the batch at d; interleaving and
        ``check_config`` at v (the same for every ZeRO stage). A refusal is counted by its reason."""
        why = self._heads(c) if name == "t" else self._grid(c) if name == "d" else self._chunk(c) if name == "v" else None
        if why is not None:
            self.res.reject(*why)
        return why is None

    def _heads(self, c: Chosen) -> tuple[str, str] | None:
        heads = heads_split(self.model, c["t"])
        return ("heads", heads) if heads else None

    def _grid(self, c: Chosen) -> tuple[str, str] | None:
        """Why the (t, cp, p, d) grid fails: a d pin, stages that cannot hold the layers, d not dividing the batch."""
        n, t, cp, p, d, split, layers = self.cluster.gpus, c["t"], c["cp"], c["p"], c["d"], self.split, self.model.layers
        if self.pins["d"] is not None and d != self.pins["d"]:
            return "pins", f"d = {self.pins['d']} but t·cp·p = {t * cp * p} leaves d = {d} on {n} GPUs"
        if p > layers + 2 or (split is not None and len(split) % p) or (
                self.a.uniform_stages and layers % p):  # the reference's model: equal stages only
            return "layers", (f"p = {p} stages cannot hold the {layers} layers"
                              + (f" as {len(split)} chunks" if split is not None else ""))
        if self.batch % d:
            return "batch", f"d = {d} does not divide batch ({self.batch})"
        return None

    def _chunk(self, c: Chosen) -> tuple[str, str] | None:
        """Why v fails: interleaving needs microbatches divisible by p; else ``check_config``'s reason."""
        m, p, v = self.batch // (c["d"] * c["micro_batch"]), c["p"], c["v"]
        if v > 1 and m % p:
            return "interleave", f"v = {v} needs microbatches ({m}) divisible by p = {p}"
        self._checked = self._config(c, self._zero(c["d"])[0])
        reason = check_config(self.model, self.cluster, self._checked, self.batch, self.a)
        return ("layers", reason) if reason else None

    def _config(self, c: Chosen, zero: int) -> ParallelConfig:
        """The layout of the chosen values at ZeRO stage ``zero``."""
        return ParallelConfig(stage_layers=self.split, zero=zero, **{n: c[n] for n in self._fields})

    def ends(self, name: str, index: int, outcome: Outcome) -> str | None:
        """A fitting ZeRO stage ends the ZeRO loop; nothing fitting at the first v (the fewest microbatches in flight:
        1F1B's p < p + (p − 1)/v) ends the micro-batch loop."""
        if name == "zero" and outcome:
            return "zero"
        return "micro_batch" if name == "v" and index == 0 and outcome is False else None

    def leaf(self, c: Chosen) -> Outcome:
        """Price the layout if it fits; else count it under memory and keep the leanest."""
        checked = self._checked  # zero follows v: the layout checked there, at its first stage
        cfg = checked if checked is not None and checked.zero == c["zero"] else self._config(c, c["zero"])
        memory = memory_breakdown(self.model, cfg, self.batch // (cfg.d * cfg.micro_batch), self.a)
        need, res = sum(memory.values()), self.res
        if need <= self.limit:
            res.ranked.append(estimate_checked(self.model, self.cluster, cfg, self.batch, self.a, memory))
            return True
        res.reject("memory", f"{_short(cfg)} needs {need / 1e9:.1f} GB > {self.limit / 1e9:.0f} GB")
        if res.leanest is None or need < sum(res.leanest.memory.values()):
            res.leanest = estimate_checked(self.model, self.cluster, cfg, self.batch, self.a, memory)
        return False


def _short(cfg: ParallelConfig) -> str:
    sp = " sp" if cfg.sequence_parallel else ""
    zero = f" zero{cfg.zero}" if cfg.zero else ""
    cp = f" cp={cfg.cp}" if cfg.cp > 1 else ""
    ep = f" ep={cfg.ep}" if cfg.ep > 1 else ""
    return f"t={cfg.t}{cp} p={cfg.p} d={cfg.d}{ep} b={cfg.micro_batch} v={cfg.v} {cfg.recompute}{sp}{zero}"
