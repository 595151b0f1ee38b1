"""Process groups for one rank of a (pp, dp, cp, tp) run, all from one DeviceMesh (§6.1).

Tensor-parallel groups are consecutive ranks (inside a machine), context-parallel next, pipeline
groups the slowest index (across machines), data-parallel in between; ``modelpar.distributed.ParallelDims``
owns the layout and the mesh its groups and this rank's place in them. Gradients are reduced over
the "dp_cp" group, the d·cp ranks that hold the same parameters (Megatron-core's data-parallel
group with context parallelism): a cp rank's gradient is its tokens' share of the replica's. Tied embeddings split across
stages also need the "embedding group": the first and last rank of each pipeline group
(Megatron's ``_EMBEDDING_GROUP``). Every group times out after the run's ``timeout``, except the
pipeline groups on NCCL, whose watchdog must let a receive posted at a step's start wait for the
step (``modelpar.pipeline.bounded_comm.step_timeout``; docs/stopping.md).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from modelpar.distributed.mesh import DIM_NAMES
from modelpar.pipeline.bounded_comm import step_timeout
from modelpar.schedules import Schedule
from modelpar.training.config import TrainConfig

__all__ = ["RankSetup", "release_rank", "setup_rank"]


@dataclass
class RankSetup:
    """This rank's coordinates and groups; a group is None where its dimension has size 1."""

    mesh: DeviceMesh  # (pp, dp, cp, tp)
    pp_group: Any  # always a ProcessGroup: the pipeline runner's devices
    tp_group: Any
    dp_group: Any
    embed_group: Any
    pp_rank: int
    dp_rank: int
    tp_rank: int
    cp_group: Any  # the ranks splitting each sequence
    cp_rank: int
    grad_group: Any  # dp × cp: where gradients are averaged and ZeRO shards (dp_group when cp = 1)
    grad_rank: int  # this rank's index in it: dp_rank · cp + cp_rank
    device: torch.device
    timeout: float
    pipeline_timeout: float  # the pp groups' NCCL watchdog timeout (step_timeout); ``timeout`` on gloo
    ep_group: Any = None  # expert parallelism (modelpar.distributed.experts): replicas sharing out the experts
    edp_group: Any = None  # and the replicas holding the same experts (None where one rank)


def _group(dim: DeviceMesh) -> Any:
    """The dimension's process group, or None (no communication) where it holds one rank."""
    return dim.get_group() if dim.size() > 1 else None


def _embedding_group(mesh: DeviceMesh, timeout: float) -> Any:
    """This rank's group of the first and last pipeline stage (None if it is neither).

    ``new_group`` is collective over the world: every rank creates every pair, in the same order.
    """
    ranks = mesh.mesh  # [pp, dp, cp, tp] tensor of global ranks
    mine = None
    for first, last in zip(ranks[0].flatten().tolist(), ranks[-1].flatten().tolist()):
        group = dist.new_group([first, last], timeout=datetime.timedelta(seconds=timeout))
        if dist.get_rank() in (first, last):
            mine = group
    return mine


def _grad_group(mesh: DeviceMesh, timeout: float) -> Any:
    """This rank's group of the dp·cp ranks sharing its (pp, tp) indices (None if it holds one rank).

    ``new_group`` is collective over the world: every rank creates every group, in the same order.
    """
    ranks = mesh.mesh  # [pp, dp, cp, tp]
    if ranks.shape[1] * ranks.shape[2] == 1:
        return None
    mine = None
    for members in ranks.permute(0, 3, 1, 2).flatten(2).flatten(0, 1).tolist():
        group = dist.new_group(members, timeout=datetime.timedelta(seconds=timeout))
        if dist.get_rank() in members:
            mine = group
    return mine


def _expert_groups(cfg: TrainConfig, timeout: float) -> tuple[Any, Any]:
    """This rank's expert-parallel and expert-data-parallel groups (``new_group`` for every group, on every rank)."""
    from modelpar.distributed.experts import expert_rank_groups

    mine: list[Any] = [None, None]
    for kind, groups in enumerate(expert_rank_groups(cfg.pp, cfg.dp, cfg.tp, cfg.ep)):
        for ranks in groups:
            group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout))
            if dist.get_rank() in ranks and len(ranks) > 1:
                mine[kind] = group
    return mine[0], mine[1]


def setup_rank(cfg: TrainConfig, schedule: Schedule, timeout: float = 300.0) -> RankSetup:
    """Build the mesh and groups (a collective: every rank calls it with the same ``cfg``); ``schedule``, the one the
    run executes, sets the pipeline groups' timeout under NCCL (a whole step's)."""
    use_cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    pipeline_backend = "gloo" if use_cuda and cfg.pipeline_gloo else None
    on_nccl = use_cuda and not cfg.pipeline_gloo
    pipeline_timeout = step_timeout(schedule, timeout) if on_nccl else timeout
    mesh = cfg.dims.build_mesh("cuda" if use_cuda else "cpu", pipeline_backend=pipeline_backend, timeout=timeout,
                               pipeline_timeout=pipeline_timeout)
    pp, dp, cp, tp = mesh["pp"], mesh["dp"], mesh["cp"], mesh["tp"]
    tied_across_stages = cfg.model.tie_embeddings and cfg.pp > 1
    dp_group = _group(dp)
    ep_group, edp_group = _expert_groups(cfg, timeout) if cfg.ep > 1 else (None, None)
    return RankSetup(
        mesh=mesh,
        pp_group=pp.get_group(),
        tp_group=_group(tp),
        dp_group=dp_group,
        embed_group=_embedding_group(mesh, timeout) if tied_across_stages else None,
        pp_rank=pp.get_local_rank(), dp_rank=dp.get_local_rank(), tp_rank=tp.get_local_rank(),
        cp_group=_group(cp), cp_rank=cp.get_local_rank(),
        grad_group=dp_group if cfg.cp == 1 else _grad_group(mesh, timeout),
        grad_rank=dp.get_local_rank() * cfg.cp + cp.get_local_rank(),
        device=device, timeout=timeout, pipeline_timeout=pipeline_timeout, ep_group=ep_group, edp_group=edp_group,
    )


def release_rank(rs: RankSetup) -> None:
    """Destroy the process groups ``setup_rank`` created, and with them their threads (a collective: every rank
    calls it at the end of its run). A process that trains again (a reused ``LocalCluster``, the test suite)
    would otherwise keep every run's groups alive, each with its gloo threads: hundreds after a few dozen runs."""
    groups = [rs.mesh.get_group(dim) for dim in DIM_NAMES]
    groups += [rs.embed_group, rs.grad_group, rs.ep_group, rs.edp_group]
    done: set[int] = set()
    for group in groups:
        if group is None or group is dist.group.WORLD or id(group) in done:
            continue  # the default group is the launcher's
        done.add(id(group))
        dist.destroy_process_group(group)
