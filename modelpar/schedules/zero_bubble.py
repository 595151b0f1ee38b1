"""Zero-bubble and V-shaped schedules: ZB-H2, ZB-V, V-Half, V-Min, DualPipe-V.

All split the backward into I (input gradient) and W (weight gradient). ZB-V and DualPipe-V
follow torch.distributed.pipelining's ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``
action for action (DualPipe-V's full backwards B are written I then W; its overlapped F+B pairs
are marked where torch writes ``OVERLAP_F_B``, each a forward and the I of a full backward, and
run and priced together: ``schedules.overlap``). The others are planned with the given F, I, W
times (``costs=``, default equal); held counts a microbatch from F until W (``memory``):

    schedule    placement            how                             held per rank (1F1B: K on rank 0)
    zb-h2       one stage a rank     list scheduler (``greedy``)     ≤ 2K − 1                (2024a §3.1)
    v-min       V: d and 2K − 1 − d  repeated block (``periodic``)   ≤ ⌈(K + 2)/3⌉           (2024b §3–4)
                                     or per-stage windows (``greedy``)
    v-half      V                    the same, a looser bound        ≤ ⌈(K + 2)/2⌉           (2024b §4)

Qi et al. 2024a: "Zero Bubble Pipeline Parallelism" (ICLR 2024); 2024b: "Pipeline Parallelism
with Controllable Memory" (NeurIPS 2024); DualPipe: DeepSeek-V3 technical report §3.2.1.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping

from modelpar._validate import check_int
from modelpar.schedules.action import Action, Kind
from modelpar.schedules.greedy import greedy
from modelpar.schedules.kinds import kind_times
from modelpar.schedules.periodic import periodic
from modelpar.schedules.replay import replay_times
from modelpar.schedules.rules import MicrobatchRule
from modelpar.schedules.schedule import Schedule, contiguous_map, v_map
from modelpar.schedules.search import peak

__all__ = ["DUALPIPE_MICROBATCHES", "dualpipe_v", "v_half", "v_min", "zb_h2", "zb_v"]

_F, _B, _I, _W = Kind.F, Kind.B, Kind.I, Kind.W
DUALPIPE_MICROBATCHES = MicrobatchRule(least_per_rank=2)  # pairs microbatches from both ends of the V


def _counts(ranks: int, microbatches: int) -> tuple[int, int]:
    return check_int("ranks", ranks, minimum=1), check_int("microbatches", microbatches, minimum=1)


Costs = Mapping[Kind, float]  # T_F, T_I, T_W of one whole stage (a chunk's action: 1/v of it)


def _times(costs: Costs | None) -> dict[Kind, float]:
    """F, I, W times of a whole stage from ``costs`` (default 1 each); ValueError unless each is >= 0, one > 0."""
    t = {k: float((costs or {}).get(k, 1.0)) for k in (_F, _I, _W)}
    if not (all(x >= 0 for x in t.values()) and sum(t.values()) > 0):
        raise ValueError(f"costs must give F, I and W times >= 0, not all 0, got {dict(costs or {})}")
    return t


def _durations(times: Mapping[Kind, float], stages: int, chunks: int) -> dict[Kind, list[float]]:
    """Each kind's time on each of ``stages`` virtual stages, v = ``chunks`` a rank (B = I + W)."""
    whole = kind_times(times[_F], times[_I] + times[_W], times[_W])
    return {k: [x / chunks] * stages for k, x in whole.items()}


def _timer(times: Mapping[Kind, float]) -> Callable[[Schedule], float]:
    """A schedule's step time under ``times`` (free transfers), to choose among candidates."""
    def step(schedule: Schedule) -> float:
        _, ends = replay_times(schedule, _durations(times, schedule.num_stages, schedule.chunks))
        return max((max(e) for e in ends if e), default=0.0)
    return step


def zb_h2(*, ranks: int, microbatches: int, costs: Costs | None = None) -> Schedule:
    """ZB-H2: more warm-up forwards so W's fill the whole drain, each rank holding at most 2K − 1
    microbatches counted until W (``memory``): a full rank turns to its pending W's, so they
    interleave with the steady state (2024a §3.1, figure 4).

    Planned with ``costs`` (default equal). Step (K − 1)T_F + M(T_F + T_I + T_W) at equal times:
    only the unavoidable fill before the last rank's first forward is idle.
    """
    k, m = _counts(ranks, microbatches)
    t = _times(costs)
    return greedy(contiguous_map(k), m, 2 * k - 1, durations=_durations(t, k, 1), name="zb-h2")


# the V blocks' shapes tried (``periodic``): the period's slack, and the offsets between one stage's
# F (I) and the next one's, in 1/60 of the period: a longer offset or period trades lifespan for speed
_SLACKS = (0.0, 0.05, 0.1)
_GAPS = tuple(range(11))
# the times' ratios to F are rounded to this many digits before the search: `--plan auto` prices hundreds of
# layouts whose ratios differ in the second digit, one search serves them all (a search lays out 364 blocks), and
# the shapes tried step by 1/60 of the period, coarser than the rounding's effect
_RATIO_DIGITS = 1


def _v_shapes(t: Mapping[Kind, float]) -> list[dict]:
    """``periodic``'s arguments for each block shape tried: the equal-times block, then the given times'."""
    unit = sum(t.values()) / 60
    return [{}, *({"costs": t, "slack": x, "gap": (f * unit, i * unit)} for x in _SLACKS for f in _GAPS for i in _GAPS)]


def _fastest_v(k: int, m: int, costs: Costs | None, limit: float, name: str) -> Schedule:
    """The faster under ``costs`` of two V constructions within ``limit`` held: the fastest repeated
    block shape (``periodic``) and the list scheduler with per-stage windows (``greedy``); each is
    chosen on min(M, 2K) microbatches (past the warm-up every shape repeats), then built for M."""
    t = _times(costs)
    unit = t[_F] or sum(t.values())  # a block's shape depends on the times' ratios only: one search for all scales
    items = tuple((kind, round(x / unit, _RATIO_DIGITS)) for kind, x in t.items())
    timer = _timer(t)
    chosen = periodic(v_map(k), m, **_fastest_shape(k, min(m, 2 * k), items, limit))
    if peak(chosen) > limit + 1e-9:
        chosen = periodic(v_map(k), m)  # the equal-times block: about K/3 held, within either bound
    windows, forward_first = _fastest_windows(k, min(m, 2 * k), items, limit)
    if windows:
        other = greedy(v_map(k), m, 2 * k, durations=_durations(t, 2 * k, 2), windows=windows,
                       forward_first=forward_first)
        if peak(other) <= limit + 1e-9 and timer(other) < timer(chosen) - 1e-9:
            chosen = other
    return Schedule(chosen.stage_to_rank, chosen.actions, name)


@functools.lru_cache(maxsize=256)
def _fastest_windows(k: int, trial: int, times: tuple[tuple[Kind, float], ...], limit: float,
                     ) -> tuple[tuple[int, ...], bool]:
    """Per-stage windows for ``greedy`` on the V and its priority (``forward_first``), fastest on ``trial``
    microbatches, the windows found by moving one unit at a time between a rank's two stages; each rank's
    windows sum to its bound in chunks, so the peak stays within ``limit``. Starts from the split of the
    lifespans (a stage's microbatch lives from its F down the V and back up to its W: long on the first
    chunk, short on the second). ((), False) when the bound leaves a stage no window."""
    t = dict(times)
    stages, cap = 2 * k, math.floor(2 * limit + 1e-9)
    if cap < 2:
        return (), False
    life = [(stages - s) * (t[_F] + t[_I]) / 2 + t[_W] / 2 for s in range(stages)]
    seed = [0] * stages
    for d in range(k):
        a = max(1, min(cap - 1, round(cap * life[d] / (life[d] + life[stages - 1 - d]))))
        seed[d], seed[stages - 1 - d] = a, cap - a
    durations, timer = _durations(t, stages, 2), _timer(t)

    found: tuple[float, tuple[int, ...], bool] = (math.inf, (), False)
    for first in (False, True):  # I's first (as ZB-H2), then forwards first: neither is always faster

        def step(w: list[int], first: bool = first) -> float:
            return timer(greedy(v_map(k), trial, 2 * k, durations=durations, windows=w, forward_first=first))

        win, best, moved = seed, step(seed), True
        while moved:
            moved = False
            for d in range(k):
                for delta in (1, -1):
                    w = list(win)
                    w[d] += delta
                    w[stages - 1 - d] -= delta
                    if min(w[d], w[stages - 1 - d]) >= 1 and (x := step(w)) < best - 1e-9:
                        best, win, moved = x, w, True
        if best < found[0] - 1e-9:
            found = (best, tuple(win), first)
    return found[1], found[2]


@functools.lru_cache(maxsize=256)
def _fastest_shape(k: int, trial: int, times: tuple[tuple[Kind, float], ...], limit: float) -> dict:
    """``periodic``'s arguments of the fastest shape on ``trial`` microbatches within ``limit`` (kept: the
    search lays out a few hundred blocks, and every M past 2K, V-Min and V-Half ask it again)."""
    t = dict(times)
    timer = _timer(t)
    seen: set[tuple] = set()
    best: tuple[float, dict] = (math.inf, {})
    for shape in _v_shapes(t):
        s = periodic(v_map(k), trial, **shape)
        if s.actions in seen or peak(s) > limit + 1e-9:
            continue
        seen.add(s.actions)
        step = timer(s)
        if step < best[0] - 1e-12:
            best = (step, shape)
    return best[1]


def v_half(*, ranks: int, microbatches: int, costs: Costs | None = None) -> Schedule:
    """V-Half: V placement, at most ⌈(K + 2)/2⌉ microbatches' activations held on any rank (until W).

    The fastest under ``costs`` (default equal) of the building blocks laid out in those times
    (``periodic``) and of the windowed list schedules (``greedy``) that stays within that bound.
    """
    k, m = _counts(ranks, microbatches)
    return _fastest_v(k, m, costs, math.ceil((k + 2) / 2), "v-half")


def v_min(*, ranks: int, microbatches: int, costs: Costs | None = None) -> Schedule:
    """V-Min: V placement, at most ⌈(K + 2)/3⌉ microbatches' activations held per rank (until W): the
    fastest under ``costs`` of the compact repeated blocks (``periodic``) and the windowed list
    schedules (``greedy``) within that bound."""
    k, m = _counts(ranks, microbatches)
    return _fastest_v(k, m, costs, math.ceil((k + 2) / 3), "v-min")


def zb_v(*, ranks: int, microbatches: int) -> Schedule:
    """ZB-V (Qi et al. 2024a §6), as torch's ``ScheduleZBVZeroBubble``: V placement, warm-up on
    chunk 0, then chunk 1 with its I and W right behind, then F/I/W of both chunks in turn."""
    k, m = _counts(ranks, microbatches)
    n = max(2 * k - 1, m)  # torch plans at least 2K − 1 microbatches and drops the extra ones
    per_rank = []
    for d in range(k):
        c0, c1 = d, 2 * k - 1 - d
        acts: list[Action] = []
        f0 = f1 = b0 = b1 = 0
        for _ in range(2 * (k - d) - 1):
            acts.append(Action(c0, _F, f0))
            f0 += 1
        for _ in range(d):
            acts += [Action(c1, _F, f1), Action(c0, _F, f0)]
            f1, f0 = f1 + 1, f0 + 1
        for _ in range(k - d):
            acts += [Action(c1, _F, f1), Action(c1, _I, b1), Action(c1, _W, b1)]
            f1, b1 = f1 + 1, b1 + 1
        while f1 < f0 or f0 < n:
            if f0 < n:
                acts.append(Action(c0, _F, f0))
                f0 += 1
            acts += [Action(c0, _I, b0), Action(c0, _W, b0), Action(c1, _F, f1), Action(c1, _I, b1),
                     Action(c1, _W, b1)]
            b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
        w0, w1 = b0, b1
        for _ in range(d):
            acts += [Action(c0, _I, b0), Action(c1, _I, b1)]
            b0, b1 = b0 + 1, b1 + 1
        for _ in range(k - d):
            acts += [Action(c0, _I, b0), Action(c0, _W, w0)]
            b0, w0 = b0 + 1, w0 + 1
        acts += [Action(c1, _W, j) for j in range(w1, b1)]
        acts += [Action(c0, _W, j) for j in range(w0, b0)]
        per_rank.append(tuple(a for a in acts if a.microbatch < m))
    return Schedule(v_map(k), tuple(per_rank), "zb-v")


def dualpipe_v(*, ranks: int, microbatches: int, overlap: bool = True) -> Schedule:
    """DualPipe-V (DeepSeek's DualPipe folded onto a V), as torch's ``ScheduleDualPipeV``.

    Needs M ≥ 2K. The main phase pairs a chunk-0 forward with a chunk-1 backward and vice versa,
    each pair overlapped (``Schedule.overlapped``: one half's communication behind the other's
    compute); ``overlap=False`` keeps the order but runs each pair back to back (registered as
    "dualpipe-v-serial", to compare). The last microbatches' backwards are split into I and W,
    the W's filling the drain.
    """
    k, m = _counts(ranks, microbatches)
    name = "dualpipe-v" if overlap else "dualpipe-v-serial"
    DUALPIPE_MICROBATCHES.check(name, m, k, 2)
    ranks_ = [_dualpipe_rank(k, m, d) for d in range(k)]
    pairs = tuple(p if overlap else () for _, p in ranks_)
    return Schedule(v_map(k), tuple(a for a, _ in ranks_), name, pairs)


def _dualpipe_rank(k: int, m: int, d: int) -> tuple[tuple[Action, ...], tuple[int, ...]]:
    """Device d's actions, step by step as torch's ``ScheduleDualPipeV`` writes them, and the positions
    of its overlapped pairs' forwards."""
    s0, s1 = d, 2 * k - 1 - d
    acts: list[Action] = []
    pairs: list[int] = []
    count: dict[tuple[int, Kind], int] = {}
    weights: list[tuple[int, int]] = []

    def add(stage: int, kind: Kind) -> None:
        key = (stage, _I if kind is _B else kind)
        j = count.get(key, 0)
        count[key] = j + 1
        if kind is _B:  # a full backward: I with its W right behind
            acts.extend((Action(stage, _I, j), Action(stage, _W, j)))
        else:
            acts.append(Action(stage, kind, j))
            if kind is _I:
                weights.append((stage, j))

    def weight() -> None:
        if weights:
            acts.append(Action(weights[0][0], _W, weights.pop(0)[1]))

    def pair(forward: int, backward: int) -> None:  # torch's OVERLAP_F_B: F with a full backward
        pairs.append(len(acts))
        add(forward, _F)
        add(backward, _B)

    for _ in range(2 * (k - d - 1)):  # 1: F0
        add(s0, _F)
    for _ in range(d + 1):  # 2: F0 F1
        add(s0, _F)
        add(s1, _F)
    for _ in range(k - d - 1):  # 3: I1 W F1
        add(s1, _I)
        weight()
        add(s1, _F)
    for i in range(m - 2 * k + d + 1):  # 4: (F0 B1) (F1 B0)
        if i == 0 and d == k - 1:  # torch: not overlapped, "to further reduce bubble size"
            add(s0, _F)
            add(s1, _B)
        else:
            pair(s0, s1)
        pair(s1, s0)
    for _ in range(k - d - 1):  # 5: B1 (F1 B0)
        add(s1, _B)
        pair(s1, s0)
    split = False
    for i in range(d + 1):  # 6: B1 B0, the second half split
        if i == (d + 1) // 2 and d % 2 == 1:
            split = True
        add(s1, _I if split else _B)
        if i == (d + 1) // 2 and d % 2 == 0:
            split = True
        add(s0, _I if split else _B)
    for _ in range(k - d - 1):  # 7: W B0
        weight()
        add(s0, _I if split else _B)
    for _ in range(d + 1):  # 8: W
        weight()
    return tuple(acts), tuple(pairs)
