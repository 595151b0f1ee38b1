"""How L layers split into a pipeline's p·v (virtual) stages: the one rule, pure Python.

The planner (``costmodel``), the simulator it drives, the pipeline runtime
(``pipeline.split_stages``) and the trainer (``model.split_stage``, ``modelpar train
--stage-layers``) all ask this module, so a split the planner recommends is one the trainer runs.

A split lists the layers of each of the p·v stages in pipeline order; with interleaving, virtual
stage k runs on rank k mod p (Megatron's placement; v = 1 is one stage per rank). The first
stage also holds the input embedding and the last the output layer, so when p·v does not divide
L those two get the fewer layers and the middle stages the extra ones: BLOOM's 70 layers on 12
stages are 5, 6, …, 6, 5 (DeepSpeed counting the two embeddings as layers, 72 = 12·6, BLOOM model
card), and Llama 3's 126 on 16 × 8 chunks leave the first and last chunk with only the embedding
and the output layer (Dubey et al. 2024 §3.3.2). Only those two may be empty.

``balance_by_cost`` cuts by per-layer costs instead (torchgpipe's ``balance_by_*``); among equally
good cuts it keeps the one closest to ``split_layers``, so equal costs give the default split.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from modelpar._validate import check_int

__all__ = [
    "balance_by_cost", "check_split", "layer_ranges", "parse_split", "rank_layers", "resolve_split", "split_layers",
]


@lru_cache(maxsize=4096)
def split_layers(layers: int, p: int, v: int = 1) -> tuple[int, ...]:
    """Layers of each of the p·v stages: ⌊L/(p·v)⌋ each, the remainder one by one to the middle stages.

    The extra layers (fewer than p·v) are spread evenly over stages 1 … p·v − 2; when there is one
    more than middle stages, the last stage takes it. Needs p·v ≤ L + 2 (at most the first and the
    last stage empty, holding only the embedding or the output layer).
    """
    n = check_int("p", p, minimum=1) * check_int("v", v, minimum=1)
    check_int("layers", layers, minimum=0)
    if n > layers + 2:
        raise ValueError(f"p·v = {n} chunks need at least {n - 2} layers, the model has {layers}")
    base, extra = divmod(layers, n)
    split = [base] * n
    middle = max(n - 2, 0)
    spread = min(extra, middle)
    for i in range(spread):  # evenly spaced over stages 1 … n − 2
        split[1 + (2 * i + 1) * middle // (2 * spread)] += 1
    if extra > spread:  # extra = n − 1: every middle stage and the last
        split[-1] += 1
    return tuple(split)


def check_split(layers: int, p: int, v: int, split: Sequence[int] | None) -> str | None:
    """Why ``split`` (or the default split) cannot place ``layers`` on p ranks × v chunks, or None."""
    if split is None:
        return None if p * v <= layers + 2 else f"p·v = {p * v} chunks need at least {p * v - 2} layers, not {layers}"
    if len(split) != p * v:
        return f"{len(split)} entries, expected p·v = {p}·{v} = {p * v}"
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in split):
        return "entries must be whole numbers >= 0"
    if sum(split) != layers:
        return f"sums to {sum(split)}, not the model's {layers} layers"
    if any(n == 0 for n in split[1:-1]):
        return "only the first and last chunk may be empty (the embedding or the output layer alone)"
    return None


def resolve_split(layers: int, p: int, v: int = 1, split: Sequence[int] | None = None) -> tuple[int, ...]:
    """``split`` checked (a ValueError naming ``stage_layers``), or ``split_layers`` when None."""
    reason = check_split(layers, p, v, split)
    if reason is not None:
        shown = "default" if split is None else ",".join(map(str, split))
        raise ValueError(f"stage_layers {shown}: {reason}")
    return split_layers(layers, p, v) if split is None else tuple(split)


def parse_split(text: str, name: str = "--stage-layers") -> tuple[int, ...]:
    """``"5,6,6,5"`` as ``(5, 6, 6, 5)``; anything else is a ValueError naming ``name``."""
    try:
        return tuple(int(x) for x in str(text).split(","))
    except ValueError:
        raise ValueError(f"{name} must be comma-separated whole numbers, got {text!r}") from None


def layer_ranges(split: Sequence[int]) -> list[range]:
    """Global indices of each stage's layers: consecutive runs of ``split[s]`` layers."""
    ranges, start = [], 0
    for n in split:
        ranges.append(range(start, start + n))
        start += n
    return ranges


@lru_cache(maxsize=4096)
def rank_layers(split: tuple[int, ...], p: int) -> tuple[int, ...]:
    """Layers on each of the p ranks: the sum of its stages k, k + p, k + 2p, …"""
    return tuple(sum(split[r::p]) for r in range(p))




def balance_by_cost(costs: Sequence[float], partitions: int) -> list[int]:
    """Layers per stage for ``partitions`` contiguous stages minimising the largest stage cost.

    ``costs[i]`` is layer i's cost (>= 0). The cut is exact (dynamic programming). Among cuts with
    the same largest (cost, layers), the one whose boundaries are nearest ``split_layers``'s, so
    equal costs give the default split. O(K·n²), fine for the hundreds of layers a model has.
    """
    n = len(costs)
    k = check_int("partitions", partitions, minimum=1)
    if n == 0:
        raise ValueError("costs must hold at least one layer, got an empty list")
    if k > n:
        raise ValueError(f"partitions ({k}) must be <= the number of layers ({n})")
    if any(not c >= 0 for c in costs):  # also catches NaN
        raise ValueError(f"costs must be >= 0, got {list(costs)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def stage(j: int, i: int) -> tuple[float, int]:
        return prefix[i] - prefix[j], i - j

    # 1. the bottleneck: the smallest largest (cost, layers) over all cuts (a total order, so the
    #    usual min-max recurrence over "first i layers into p stages" is exact)
    inf = (float("inf"), n + 1)
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    best[0][0] = (0.0, 0)
    for p in range(1, k + 1):
        for i in range(p, n - (k - p) + 1):
            best[p][i] = min(max(best[p - 1][j], stage(j, i)) for j in range(p - 1, i))
    bottleneck = best[k][n]
    # 2. among the cuts within it, the nearest to the default split (sum of boundary distances)
    default = [0, *(r.stop for r in layer_ranges(split_layers(n, k)))]
    far = float("inf")
    dist = [[far] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    dist[0][0] = 0.0
    for p in range(1, k + 1):
        for i in range(p, n - (k - p) + 1):
            for j in range(p - 1, i):
                if dist[p - 1][j] < far and stage(j, i) <= bottleneck and dist[p - 1][j] < dist[p][i]:
                    dist[p][i], cut[p][i] = dist[p - 1][j], j
            dist[p][i] += abs(i - default[p])
    balance, i = [], n
    for p in range(k, 0, -1):
        j = cut[p][i]
        balance.append(i - j)
        i = j
    return balance[::-1]
