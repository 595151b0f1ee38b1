"""Process groups for 4D parallelism: one grid of ranks, (pp, dp, cp, tp), tensor-parallel innermost.

Rank layout (picotron / Megatron-core's tp-cp-dp-pp order):
``rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index``, i.e.
``torch.arange(world).view(pp, dp, cp, tp)``. Tensor-parallel groups are runs of ``tp`` consecutive
ranks, so with ``tp`` ≤ GPUs per node they stay inside one machine (NVLink); context-parallel
groups come next (their ring or all-gather traffic is the next heaviest); pipeline stages are
the slowest-varying index and cross machines (point-to-point, little traffic). With cp = 1 the
layout is the 3D one, (pp, dp, tp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from modelpar._validate import check_int

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ParallelDims", "coordinates", "dim_settings", "group_options", "rank_groups"]

DIM_NAMES = ("pp", "dp", "cp", "tp")


def coordinates(rank: int, pp: int, dp: int, tp: int, cp: int = 1) -> dict[str, int]:
    """The (pp, dp, cp, tp) indices of ``rank`` in the grid: the inverse of the layout above."""
    return {"pp": rank // (dp * cp * tp), "dp": rank // (cp * tp) % dp, "cp": rank // tp % cp, "tp": rank % tp}


def rank_groups(pp: int = 1, dp: int = 1, tp: int = 1, cp: int = 1) -> dict[str, list[list[int]]]:
    """All rank groups along each dimension of the (pp, dp, cp, tp) grid, and "dp_cp": the gradient
    reduction groups, the ranks that differ only in (dp, cp) (cp joins data parallelism for gradients).

    A group along dimension X holds the ranks whose other indices are equal. Example
    pp = dp = tp = 2: tp groups [[0,1],[2,3],[4,5],[6,7]], dp [[0,2],[1,3],[4,6],[5,7]],
    pp [[0,4],[1,5],[2,6],[3,7]].
    """
    sizes = {"pp": check_int("pp", pp, minimum=1), "dp": check_int("dp", dp, minimum=1),
             "cp": check_int("cp", cp, minimum=1), "tp": check_int("tp", tp, minimum=1)}
    sizes["dp_cp"] = dp * cp
    world = pp * dp * cp * tp
    groups: dict[str, list[list[int]]] = {}
    for dim in (*DIM_NAMES, "dp_cp"):
        varying = ("dp", "cp") if dim == "dp_cp" else (dim,)
        by_rest: dict[tuple[int, ...], list[int]] = {}
        for rank in range(world):
            c = coordinates(rank, pp, dp, tp, cp)
            key = tuple(c[d] for d in DIM_NAMES if d not in varying)
            by_rest.setdefault(key, []).append(rank)
        groups[dim] = sorted(by_rest.values())
    assert all(len(g) == sizes[d] for d, gs in groups.items() for g in gs)
    return groups


@dataclass(frozen=True)
class ParallelDims:
    """Validated (pp, dp, cp, tp) sizes; ``build_mesh`` turns them into a torch DeviceMesh."""

    pp: int = 1  # pipeline-parallel stages
    dp: int = 1  # data-parallel replicas
    tp: int = 1  # tensor-parallel shards
    cp: int = 1  # context-parallel ranks (each sequence split across them)

    def __post_init__(self) -> None:
        for name in DIM_NAMES:
            check_int(name, getattr(self, name), minimum=1)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def check_world(self, world_size: int) -> None:
        """Raise ValueError unless t·cp·p·d equals the number of processes."""
        if world_size != self.world_size:
            names, sizes = ("tp * cp * pp * dp", (self.tp, self.cp, self.pp, self.dp)) if self.cp > 1 else \
                ("tp * pp * dp", (self.tp, self.pp, self.dp))
            raise ValueError(f"{names} = {' * '.join(map(str, sizes))} = {self.world_size} must equal "
                             f"the number of processes (world size {world_size})")

    def coordinates(self, rank: int) -> dict[str, int]:
        return coordinates(rank, self.pp, self.dp, self.tp, self.cp)

    def build_mesh(self, device_type: str = "cpu", pipeline_backend: str | None = None,
                   timeout: float | None = None, pipeline_timeout: float | None = None) -> DeviceMesh:
        """A ``torch.distributed.device_mesh.DeviceMesh`` of shape (pp, dp, cp, tp), dims named.

        ``pipeline_backend="gloo"`` gives the pp dimension its own gloo groups (NCCL runs keep NCCL
        for tp and dp): pipeline activations are then staged through host memory, if one wants that.
        ``timeout`` (seconds) bounds every collective of every group of the mesh; without it torch
        gives subgroups its 30-minute default, whatever the world's timeout is. ``pipeline_timeout``
        replaces it for the pp groups when they run on NCCL, whose watchdog times an operation from
        when it was posted (``modelpar.pipeline.bounded_comm.step_timeout``).
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.check_world(dist.get_world_size())
        world_backend = str(dist.get_backend())
        override: dict[int | str, Any] = {}
        for dim, (backend, limit) in dim_settings(world_backend, pipeline_backend, timeout, pipeline_timeout).items():
            if limit is not None:
                override[dim] = (backend, group_options(backend, limit))
            elif backend != world_backend:
                override[dim] = backend
        extra = {"backend_override": override} if override else {}  # torch >= 2.6
        return init_device_mesh(device_type, (self.pp, self.dp, self.cp, self.tp), mesh_dim_names=DIM_NAMES, **extra)


def dim_settings(world_backend: str, pipeline_backend: str | None, timeout: float | None,
                 pipeline_timeout: float | None) -> dict[str, tuple[str, float | None]]:
    """(backend, timeout) of each mesh dimension: the pp dimension may have its own backend, and on
    NCCL its own timeout; None: torch's default."""
    out = {}
    for dim in DIM_NAMES:
        backend = pipeline_backend if dim == "pp" and pipeline_backend else world_backend
        limit = pipeline_timeout if dim == "pp" and "nccl" in backend and pipeline_timeout else timeout
        out[dim] = (backend, limit)
    return out


def group_options(backend: str, timeout: float) -> Any:
    """Process-group options for ``backend`` ("gloo" or "nccl") whose collectives time out after ``timeout`` s."""
    from modelpar._compat import backend_options

    return backend_options(backend, timeout)
