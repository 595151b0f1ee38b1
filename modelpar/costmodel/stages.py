"""Where the pipeline's layers sit, for the cost model: per-rank loads and the ranks that may be busiest.

The split itself (default or ``--stage-layers``) is ``modelpar.layer_split``'s one rule, imported
here, so the planner prices the split that ``modelpar train`` runs.
"""

from __future__ import annotations

from functools import lru_cache

from modelpar.costmodel.specs import ParallelConfig
from modelpar.layer_split import check_split, rank_layers, split_layers

__all__ = ["busiest_candidates", "check_split", "rank_layers", "rank_loads", "split_layers"]


def rank_loads(layers: int, cfg: ParallelConfig) -> tuple[int, ...]:
    """Layers on each pipeline rank of ``cfg``: its pinned ``stage_layers`` or the default split."""
    split = cfg.stage_layers if cfg.stage_layers is not None else split_layers(layers, cfg.p, cfg.v)
    return rank_layers(split, cfg.p)




@lru_cache(maxsize=4096)
def busiest_candidates(loads: tuple[int, ...]) -> tuple[int, ...]:
    """Devices that can be the most loaded: the first and the last (embeddings) and, for each layer
    count, the first rank holding it (earlier ranks keep more microbatches in flight)."""
    seen: set[int] = set()
    ranks = []
    for rank, n in enumerate(loads):
        if rank in (0, len(loads) - 1) or n not in seen:
            ranks.append(rank)
            seen.add(n)
    return tuple(ranks)

