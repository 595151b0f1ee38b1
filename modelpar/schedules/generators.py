"""Schedule generators: naive, GPipe, 1F1B, interleaved 1F1B, Looped BFS, ZB-H1
here; ZB-H2, ZB-V, V-Half, V-Min and DualPipe-V in ``zero_bubble``.

Each returns a ``Schedule`` with K ranks (stage s on rank s, except interleaved and Looped
BFS: rank d holds stages d, d + K, ...; and the V shapes: d and 2K − 1 − d). Orders follow
the papers; nothing about timing lives here, the simulator derives it. Reference: lecture §1.2
(naive), §2.3 (GPipe), §4.1 (1F1B), §4.2 (interleaved); Qi et al. 2024, "Zero Bubble Pipeline
Parallelism", §3.1 (ZB-H1); Lamy-Poirier 2022, "Breadth-First Pipeline Parallelism" (Looped BFS).
"""

from __future__ import annotations

from modelpar._validate import check_int
from modelpar.schedules.action import Action, Kind
from modelpar.schedules.rules import MicrobatchRule
from modelpar.schedules.schedule import Schedule, contiguous_map, loop_map

__all__ = [
    "INTERLEAVED_MICROBATCHES",
    "gpipe",
    "interleaved_1f1b",
    "looped_bfs",
    "naive",
    "one_f_one_b",
    "zb_h1",
]

_F, _B, _I, _W = Kind.F, Kind.B, Kind.I, Kind.W
INTERLEAVED_MICROBATCHES = MicrobatchRule(multiple_of_ranks=True)  # M in groups of K through each chunk


def _counts(ranks: int, microbatches: int) -> tuple[int, int]:
    return check_int("ranks", ranks, minimum=1), check_int("microbatches", microbatches, minimum=1)


def _frozen(per_rank: list[list[Action]]) -> tuple[tuple[Action, ...], ...]:
    return tuple(map(tuple, per_rank))


def naive(*, ranks: int, microbatches: int = 1) -> Schedule:
    """Naive model parallelism (§1.2): one microbatch at a time goes all the way down and back.

    With M = 1 (the whole batch at once) only one rank works at any moment: utilisation 1/K.
    """
    k, m = _counts(ranks, microbatches)
    per_rank = [[a for j in range(m) for a in (Action(d, _F, j), Action(d, _B, j))] for d in range(k)]
    return Schedule(contiguous_map(k), _frozen(per_rank), "naive")


def gpipe(*, ranks: int, microbatches: int) -> Schedule:
    """GPipe (Huang et al. 2019; §2.3): all M forwards, then all M backwards, last microbatch first."""
    k, m = _counts(ranks, microbatches)
    per_rank = [
        [Action(d, _F, j) for j in range(m)] + [Action(d, _B, j) for j in reversed(range(m))]
        for d in range(k)
    ]
    return Schedule(contiguous_map(k), _frozen(per_rank), "gpipe")


def one_f_one_b(*, ranks: int, microbatches: int) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al. 2019; §4.1).

    Rank d runs K - d - 1 warm-up forwards, then alternates one forward and one backward, then
    drains the remaining backwards, so at most K - d microbatches are in flight on it. With
    M < K the warm-up is capped at M: the schedule degrades to GPipe's order, still valid.
    """
    k, m = _counts(ranks, microbatches)
    per_rank = []
    for d in range(k):
        warm = min(k - d - 1, m)
        acts = [Action(d, _F, j) for j in range(warm)]
        for j in range(m - warm):
            acts += [Action(d, _F, warm + j), Action(d, _B, j)]
        acts += [Action(d, _B, j) for j in range(m - warm, m)]
        per_rank.append(acts)
    return Schedule(contiguous_map(k), _frozen(per_rank), "1f1b")


def interleaved_1f1b(*, ranks: int, microbatches: int, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021 §2.2.2; §4.2) with v chunks per rank.

    Rank d holds virtual stages d, d + K, ..., d + (v - 1)K (the "loop" map). Microbatches go
    through a chunk in groups of K, so M must be a multiple of K. Warm-up on rank d is
    2(K - d - 1) + (v - 1)K chunk-forwards, then one forward / one backward, as in Megatron.
    ``chunks=1`` gives plain 1F1B.
    """
    k, m = _counts(ranks, microbatches)
    v = check_int("chunks", chunks, minimum=1)
    if v == 1:
        return Schedule(contiguous_map(k), one_f_one_b(ranks=k, microbatches=m).actions, "interleaved")
    INTERLEAVED_MICROBATCHES.check("interleaved", m, k, v)
    total = m * v

    # step j of a rank's F (or B) sequence: chunk (j // K) % v (B: counted from the last
    # chunk), microbatch (j // Kv) K + j % K; built in comprehensions, no call per action
    chunk_f = [(j // k) % v for j in range(total)]
    mb = [(j // (k * v)) * k + j % k for j in range(total)]
    per_rank = []
    for d in range(k):
        fwd = [Action(c * k + d, _F, j) for c, j in zip(chunk_f, mb)]
        bwd = [Action((v - 1 - c) * k + d, _B, j) for c, j in zip(chunk_f, mb)]
        warm = min(2 * (k - d - 1) + (v - 1) * k, total)
        steady = [a for pair in zip(fwd[warm:], bwd) for a in pair]
        per_rank.append(fwd[:warm] + steady + bwd[total - warm:])
    return Schedule(loop_map(k, v), _frozen(per_rank), "interleaved")


def zb_h1(*, ranks: int, microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024 §3.1): 1F1B with the backward split into I and a deferred W.

    I (input gradient) is on the critical path; W (weight gradient) is not. Rank d runs 1F1B
    with I in place of B and lets its W lag d backwards behind, so the last ranks finish
    their I's early and the deferred W's fill the drain bubble: bubble (K - 1)(T_F + T_B - T_W)
    instead of (K - 1)(T_F + T_B + T_W). In-flight microbatches (F done, I not yet) stay at
    K - d, as in 1F1B. This is torch.distributed.pipelining's ZB1P order with one chunk.
    """
    k, m = _counts(ranks, microbatches)
    per_rank = []
    for d in range(k):
        warm = min(k - d - 1, m)
        acts = [Action(d, _F, j) for j in range(warm)]
        next_w = 0
        for j in range(m):
            if j < m - warm:
                acts.append(Action(d, _F, warm + j))
            acts.append(Action(d, _I, j))
            if j >= d:
                acts.append(Action(d, _W, next_w))
                next_w += 1
        acts += [Action(d, _W, j) for j in range(next_w, m)]
        per_rank.append(acts)
    return Schedule(contiguous_map(k), _frozen(per_rank), "zb-h1")


def looped_bfs(*, ranks: int, microbatches: int, chunks: int = 2) -> Schedule:
    """Looped BFS (Lamy-Poirier 2022), as torch's ``ScheduleLoopedBFS``: loop placement; each rank
    runs all M forwards of its first chunk, then of the next, ..., then the backwards in reverse
    (last chunk first, last microbatch first). GPipe's order, chunk by chunk: memory M per rank."""
    k, m = _counts(ranks, microbatches)
    v = check_int("chunks", chunks, minimum=1)
    per_rank = []
    for d in range(k):
        mine = range(d, k * v, k)
        acts = [Action(s, _F, j) for s in mine for j in range(m)]
        acts += [Action(s, _B, j) for s in reversed(mine) for j in reversed(range(m))]
        per_rank.append(acts)
    return Schedule(loop_map(k, v), _frozen(per_rank), "looped-bfs")

