"""Process groups for one rank of a (pp, dp, tp) run, all from one DeviceMesh (§6.1).

Tensor-parallel groups are consecutive ranks (inside a machine), pipeline groups the slowest
index (across machines), data-parallel in between; ``modelpar.distributed.ParallelDims`` owns
the layout. Tied embeddings split across stages also need the "embedding group": the first and
last rank of each pipeline group (Megatron's ``_EMBEDDING_GROUP``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from modelpar.distributed import rank_groups
from modelpar.training.config import TrainConfig

__all__ = ["RankSetup", "setup_rank"]


@dataclass
class RankSetup:
    """This rank's coordinates and groups; a group is None where its dimension has size 1."""

    mesh: Any
    pp_group: Any  # always a ProcessGroup: the pipeline runner's devices
    tp_group: Any
    dp_group: Any
    embed_group: Any
    pp_rank: int
    dp_rank: int
    tp_rank: int
    device: torch.device
    timeout: float


def setup_rank(cfg: TrainConfig, timeout: float = 300.0) -> RankSetup:
    """Build the mesh and groups (a collective: every rank calls it with the same ``cfg``)."""
    dims = cfg.dims
    use_cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    mesh = dims.build_mesh("cuda" if use_cuda else "cpu", pipeline_backend="gloo" if use_cuda and cfg.pipeline_gloo else None)
    coords = dims.coordinates(dist.get_rank())
    embed_group = None
    if cfg.model.tie_embeddings and cfg.pp > 1:
        for ranks in rank_groups(cfg.pp, cfg.dp, cfg.tp)["pp"]:  # every rank creates every group
            group = dist.new_group([ranks[0], ranks[-1]])
            if dist.get_rank() in (ranks[0], ranks[-1]):
                embed_group = group
    return RankSetup(
        mesh=mesh,
        pp_group=mesh["pp"].get_group(),
        tp_group=mesh["tp"].get_group() if cfg.tp > 1 else None,
        dp_group=mesh["dp"].get_group() if cfg.dp > 1 else None,
        embed_group=embed_group,
        pp_rank=coords["pp"], dp_rank=coords["dp"], tp_rank=coords["tp"],
        device=device, timeout=timeout,
    )
