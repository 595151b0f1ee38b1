"""Zero-bubble and V-shaped schedules: ZB-H2, ZB-V, V-Half, V-Min, DualPipe-V.

All split the backward into I (input gradient) and W (weight gradient). ZB-V and DualPipe-V
follow torch.distributed.pipelining's ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``
action for action (DualPipe-V's full backwards B are written I then W; its overlapped F+B pairs
are marked where torch writes ``OVERLAP_F_B``, each a forward and the I of a full backward, and
run and priced together: ``schedules.overlap``). The others are built for equal F, I and W times:

    schedule    placement            how                           held per rank (1F1B: K on rank 0)
    zb-h2       one stage a rank   list scheduler (``greedy``)   2(K − d) − 1 on rank d  (2024a §3.1)
    v-min       V: d and 2K − 1 − d  compact repeated block        about K/3                 (2024b §3–4)
    v-half      V                    the fastest of v-min and the  ≤ ⌈(K + 2)/2⌉, about half (2024b §4)
                                     list scheduler under that limit

Qi et al. 2024a: "Zero Bubble Pipeline Parallelism" (ICLR 2024); 2024b: "Pipeline Parallelism
with Controllable Memory" (NeurIPS 2024); DualPipe: DeepSeek-V3 technical report §3.2.1.
"""

from __future__ import annotations

import math

from modelpar._validate import check_int
from modelpar.schedules.action import Action, Kind
from modelpar.schedules.greedy import greedy
from modelpar.schedules.periodic import periodic
from modelpar.schedules.rules import MicrobatchRule
from modelpar.schedules.schedule import Schedule, contiguous_map, v_map
from modelpar.schedules.search import fastest_within

__all__ = ["DUALPIPE_MICROBATCHES", "dualpipe_v", "v_half", "v_min", "zb_h2", "zb_v"]

_F, _B, _I, _W = Kind.F, Kind.B, Kind.I, Kind.W
DUALPIPE_MICROBATCHES = MicrobatchRule(least_per_rank=2)  # pairs microbatches from both ends of the V


def _counts(ranks: int, microbatches: int) -> tuple[int, int]:
    return check_int("ranks", ranks, minimum=1), check_int("microbatches", microbatches, minimum=1)


def zb_h2(*, ranks: int, microbatches: int) -> Schedule:
    """ZB-H2: more warm-up forwards (rank d holds up to 2(K − d) − 1) so W's fill the whole drain.

    Step (K − 1)T_F + M(T_F + T_B + T_W) with equal times and M ≥ 2K: only the unavoidable fill
    before the last rank's first forward is idle.
    """
    k, m = _counts(ranks, microbatches)
    return greedy(contiguous_map(k), m, [2 * (k - d) - 1 for d in range(k)], name="zb-h2")


def v_half(*, ranks: int, microbatches: int) -> Schedule:
    """V-Half: V placement, at most ⌈(K + 2)/2⌉ microbatches' activations held on any rank.

    The fastest (equal F, I, W) of V-Min's order and the list scheduler at admission limits
    1, 1.5, ... that stays within that bound; where none of the latter does better, V-Min's order.
    """
    k, m = _counts(ranks, microbatches)
    limit = math.ceil((k + 2) / 2)
    candidates = [periodic(v_map(k), m)] + [greedy(v_map(k), m, x / 2) for x in range(2, 2 * limit + 1)]
    best = fastest_within(candidates, limit)
    assert best is not None  # V-Min's order holds about K/3 <= the limit
    return Schedule(best[0].stage_to_rank, best[0].actions, "v-half")


def v_min(*, ranks: int, microbatches: int) -> Schedule:
    """V-Min: V placement, the compact repeated building block (``periodic``): about K/3
    microbatches' activations held per rank, a step no longer than 1F1B's."""
    k, m = _counts(ranks, microbatches)
    return periodic(v_map(k), m, name="v-min")


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
