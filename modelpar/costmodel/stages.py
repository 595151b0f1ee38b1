"""How the L transformer layers are split over p pipeline devices with v chunks each, even or not.

A split lists the layers of each of the p·v model chunks in pipeline order; chunk k runs on device
k mod p (Megatron's interleaved placement; v = 1 is one chunk per device). The first chunk also holds
the input embedding and the last the output layer, so when p·v does not divide L those two get the
fewer layers and the middle chunks the extra ones: BLOOM's 70 layers on 12 stages are 5, 6, …, 6, 5
(DeepSpeed counting the two embeddings as layers, 72 = 12·6, BLOOM model card) and Llama 3's 126 on
16 × 8 chunks leave the first and last chunk with only the embedding and the output layer (Dubey et
al. 2024 §3.3.2). ``--stage-layers`` pins any other split.
"""

from __future__ import annotations

from functools import lru_cache

from modelpar.costmodel.specs import ParallelConfig

__all__ = ["busiest_candidates", "check_split", "device_layers", "device_loads", "split_layers"]


@lru_cache(maxsize=4096)
def split_layers(layers: int, p: int, v: int = 1) -> tuple[int, ...]:
    """Layers of each of the p·v chunks: ⌊L/(p·v)⌋ each, the remainder one by one to the middle chunks.

    The extra layers (fewer than p·v) are spread evenly over chunks 1 … p·v − 2; when there is one more
    than middle chunks, the last chunk takes it. Needs p·v ≤ L + 2 (at most the first and the
    last chunk empty, holding only the embedding or the output layer).
    """
    n = p * v
    if n > layers + 2:
        raise ValueError(f"p·v = {n} chunks need at least {n - 2} layers, the model has {layers}")
    base, extra = divmod(layers, n)
    split = [base] * n
    middle = max(n - 2, 0)
    spread = min(extra, middle)
    for i in range(spread):  # evenly spaced over chunks 1 … n − 2
        split[1 + (2 * i + 1) * middle // (2 * spread)] += 1
    if extra > spread:  # extra = n − 1: every middle chunk and the last
        split[-1] += 1
    return tuple(split)


@lru_cache(maxsize=4096)
def device_layers(split: tuple[int, ...], p: int) -> tuple[int, ...]:
    """Layers on each of the p devices: the sum of its chunks k, k + p, k + 2p, …"""
    return tuple(sum(split[r::p]) for r in range(p))


def device_loads(layers: int, cfg: ParallelConfig) -> tuple[int, ...]:
    """Layers on each pipeline device of ``cfg``: its pinned ``stage_layers`` or the default split."""
    split = cfg.stage_layers if cfg.stage_layers is not None else split_layers(layers, cfg.p, cfg.v)
    return device_layers(split, cfg.p)


@lru_cache(maxsize=4096)
def busiest_candidates(loads: tuple[int, ...]) -> tuple[int, ...]:
    """Devices that can be the most loaded: the first and the last (embeddings) and, for each layer
    count, the first device holding it (earlier devices keep more microbatches in flight)."""
    seen: set[int] = set()
    ranks = []
    for rank, n in enumerate(loads):
        if rank in (0, len(loads) - 1) or n not in seen:
            ranks.append(rank)
            seen.add(n)
    return tuple(ranks)


def check_split(layers: int, p: int, v: int, split: tuple[int, ...] | None) -> str | None:
    """Why ``split`` (or the default split) cannot place ``layers`` on p devices × v chunks, or None."""
    if split is None:
        return None if p * v <= layers + 2 else f"p·v = {p * v} chunks need at least {p * v - 2} layers, not {layers}"
    if len(split) != p * v:
        return f"stage layers has {len(split)} entries, expected p·v = {p * v}"
    if sum(split) != layers:
        return f"stage layers sum to {sum(split)}, not the {layers} layers"
    if any(n == 0 for n in split[1:-1]):
        return "only the first and last chunk may be empty (embedding or output layer alone)"
    return None
