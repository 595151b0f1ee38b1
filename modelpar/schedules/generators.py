"""Schedule generators: naive, GPipe, 1F1B, interleaved 1F1B and ZB-H1, as plain action lists.

Each returns a ``Schedule`` with K devices (stage s on device s, except interleaved: device d
holds stages d, d + K, ...). Orders follow the papers; nothing about timing lives here, the
simulator derives it. Reference: lecture §1.2 (naive), §2.3 (GPipe), §4.1 (1F1B), §4.2
(interleaved); Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §3.1 (ZB-H1).
"""

from __future__ import annotations

from modelpar._validate import check_choice, check_divisible, check_int
from modelpar.schedules.action import Action, Kind
from modelpar.schedules.schedule import Schedule, contiguous_map, loop_map

__all__ = [
    "SCHEDULES",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "naive",
    "one_f_one_b",
    "zb_h1",
]

_F, _B, _I, _W = Kind.F, Kind.B, Kind.I, Kind.W


def _counts(stages: int, microbatches: int) -> tuple[int, int]:
    return check_int("stages", stages, minimum=1), check_int("microbatches", microbatches, minimum=1)


def _frozen(per_device: list[list[Action]]) -> tuple[tuple[Action, ...], ...]:
    return tuple(map(tuple, per_device))


def naive(*, stages: int, microbatches: int = 1) -> Schedule:
    """Naive model parallelism (§1.2): one microbatch at a time goes all the way down and back.

    With M = 1 (the whole batch at once) only one device works at any moment: utilisation 1/K.
    """
    k, m = _counts(stages, microbatches)
    per_device = [[a for j in range(m) for a in (Action(d, _F, j), Action(d, _B, j))] for d in range(k)]
    return Schedule(contiguous_map(k), _frozen(per_device), "naive")


def gpipe(*, stages: int, microbatches: int) -> Schedule:
    """GPipe (Huang et al. 2019; §2.3): all M forwards, then all M backwards, last microbatch first."""
    k, m = _counts(stages, microbatches)
    per_device = [
        [Action(d, _F, j) for j in range(m)] + [Action(d, _B, j) for j in reversed(range(m))]
        for d in range(k)
    ]
    return Schedule(contiguous_map(k), _frozen(per_device), "gpipe")


def one_f_one_b(*, stages: int, microbatches: int) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al. 2019; §4.1).

    Device d runs K - d - 1 warm-up forwards, then alternates one forward and one backward, then
    drains the remaining backwards, so at most K - d microbatches are in flight on it. With
    M < K the warm-up is capped at M: the schedule degrades to GPipe's order, still valid.
    """
    k, m = _counts(stages, microbatches)
    per_device = []
    for d in range(k):
        warm = min(k - d - 1, m)
        acts = [Action(d, _F, j) for j in range(warm)]
        for j in range(m - warm):
            acts += [Action(d, _F, warm + j), Action(d, _B, j)]
        acts += [Action(d, _B, j) for j in range(m - warm, m)]
        per_device.append(acts)
    return Schedule(contiguous_map(k), _frozen(per_device), "1f1b")


def interleaved_1f1b(*, stages: int, microbatches: int, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021 §2.2.2; §4.2) with v chunks per device.

    Device d holds virtual stages d, d + K, ..., d + (v - 1)K (the "loop" map). Microbatches go
    through a chunk in groups of K, so M must be a multiple of K. Warm-up on device d is
    2(K - d - 1) + (v - 1)K chunk-forwards, then one forward / one backward, as in Megatron.
    ``chunks=1`` gives plain 1F1B.
    """
    k, m = _counts(stages, microbatches)
    v = check_int("chunks", chunks, minimum=1)
    if v == 1:
        return Schedule(contiguous_map(k), one_f_one_b(stages=k, microbatches=m).actions, "interleaved")
    check_divisible("microbatches", m, "stages", k)
    total = m * v

    # step j of a device's F (or B) sequence: chunk (j // K) % v (B: counted from the last
    # chunk), microbatch (j // Kv) K + j % K; built in comprehensions, no call per action
    chunk_f = [(j // k) % v for j in range(total)]
    mb = [(j // (k * v)) * k + j % k for j in range(total)]
    per_device = []
    for d in range(k):
        fwd = [Action(c * k + d, _F, j) for c, j in zip(chunk_f, mb)]
        bwd = [Action((v - 1 - c) * k + d, _B, j) for c, j in zip(chunk_f, mb)]
        warm = min(2 * (k - d - 1) + (v - 1) * k, total)
        steady = [a for pair in zip(fwd[warm:], bwd) for a in pair]
        per_device.append(fwd[:warm] + steady + bwd[total - warm:])
    return Schedule(loop_map(k, v), _frozen(per_device), "interleaved")


def zb_h1(*, stages: int, microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024 §3.1): 1F1B with the backward split into I and a deferred W.

    I (input gradient) is on the critical path; W (weight gradient) is not. Device d runs 1F1B
    with I in place of B and lets its W lag d backwards behind, so the last devices finish
    their I's early and the deferred W's fill the drain bubble: bubble (K - 1)(T_F + T_B - T_W)
    instead of (K - 1)(T_F + T_B + T_W). In-flight microbatches (F done, I not yet) stay at
    K - d, as in 1F1B. This is torch.distributed.pipelining's ZB1P order with one chunk.
    """
    k, m = _counts(stages, microbatches)
    per_device = []
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
        per_device.append(acts)
    return Schedule(contiguous_map(k), _frozen(per_device), "zb-h1")


SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1")


def get_schedule(name: str, *, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    """Build schedule ``name`` (one of ``SCHEDULES``) for K stages and M microbatches.

    ``chunks`` (v) is used by "interleaved" only; the other schedules require chunks=1.
    """
    check_choice("schedule", name, SCHEDULES)
    v = check_int("chunks", chunks, minimum=1)
    if name == "interleaved":
        return interleaved_1f1b(stages=stages, microbatches=microbatches, chunks=v)
    if v != 1:
        raise ValueError(f"chunks must be 1 for schedule {name!r} (only 'interleaved' uses chunks), got {v}")
    build = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1}[name]
    return build(stages=stages, microbatches=microbatches)
