"""Data-sheet time of a data-parallel ring collective whose group may span nodes (no measured profile).

A group of ``group`` ranks ``stride`` apart (ranks ordered t, d, p) spans N nodes. Bandwidth: a rank
sends ``zero_bytes``' ring bytes R = (n − 1)/n · S (S: the buffer it all-gathers or reduce-scatters,
twice that for an all-reduce; nccl-tests' bus bandwidth, its docs/PERFORMANCE.md, is R over the time);
of them (N − 1)/N · S must cross the network, at the per-GPU network bandwidth, and R crosses NVLink;
the slower sets the time. With t = 8 on 8-GPU nodes (N = n) that is R at the network's rate, as
before; inside one node R at NVLink's. The node's other NICs are not counted as adding to one rank's
rate: SC'21 Table 2's DeepSpeed ZeRO-3 rows (t = 1 over 48-192 nodes, docs/costmodel.md) reach about
the per-GPU network rate, not the node's aggregate; ``Assumptions.ring_node_nics`` counts the g NICs
of the group's members in a node together instead (NCCL's rings, one channel per NIC, as nccl-tests
measure across nodes). Latency: NCCL's tuning model (src/graph/tuning.cc:
a base cost plus, per ring step, an NVLink or a network hop latency, Simple protocol; the per-step
figures from memory of that file, not re-read), so small messages and large groups reach a falling
fraction of the link: time = latency + bytes / bandwidth.
"""

from __future__ import annotations

from modelpar.costmodel.assumptions import Assumptions
from modelpar.costmodel.measured import collective_time
from modelpar.costmodel.specs import ClusterSpec, ParallelConfig
from modelpar.costmodel.zero_bytes import dp_bytes_per_microbatch

__all__ = ["NCCL_NET_STEP_S", "NCCL_NVLINK_STEP_S", "ring_latency", "ring_time", "sharded_dp_exposed"]

# NCCL src/graph/tuning.cc, hwLat[...][RING][SIMPLE] (µs per ring step): NVLink 3.4, network 14.0 (from memory, not re-read)
NCCL_NVLINK_STEP_S = 3.4e-6
NCCL_NET_STEP_S = 14.0e-6
_STEPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}  # ring steps per (ranks − 1); tuning.cc's nsteps


def _layout(cluster: ClusterSpec, group: int, stride: int) -> tuple[int, int]:
    """(members of the group in one node, nodes the group spans)."""
    per_node = min(max(1, cluster.gpus_per_node // stride), group) if stride < cluster.gpus_per_node else 1
    return per_node, -(-group // per_node)


def ring_latency(op: str, group: int, stride: int, cluster: ClusterSpec, a: Assumptions) -> float:
    """``collective_latency_s`` (NCCL's base cost) plus a hop latency per ring step: of the ring's
    steps × (group − 1), steps × (nodes − 1) cross the network (tuning.cc's nInterSteps), the rest NVLink
    (only ``collective_latency_s`` where ``ring_hop_latency`` is off: the reference's links without latency)."""
    if group <= 1:
        return 0.0
    if not a.ring_hop_latency:
        return a.collective_latency_s
    _, nodes = _layout(cluster, group, stride)
    steps = _STEPS.get(op, 1)
    inter = steps * (nodes - 1)
    return a.collective_latency_s + (steps * (group - 1) - inter) * NCCL_NVLINK_STEP_S + inter * NCCL_NET_STEP_S


def ring_time(nbytes: float, op: str, group: int, stride: int, cluster: ClusterSpec, a: Assumptions) -> float:
    """Seconds of a ring ``op`` in which each rank sends ``nbytes`` (``zero_bytes``' ring bytes), over ``group``
    ranks ``stride`` apart: the measured profile's cost when it has one, else ``ring_latency`` + the slower of
    NVLink (all ``nbytes``) and the network ((N − 1)/N of the whole buffer, per GPU) at ``link_efficiency``."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    span = group * stride
    if cluster.measured is not None:
        return collective_time(nbytes, cluster.link_gbps(span), a, cluster, op, group, span)
    per_node, nodes = _layout(cluster, group, stride)
    seconds = nbytes / (cluster.intra_node_gbps * 1e9)
    if nodes > 1:
        whole = nbytes * group / (group - 1)
        nics = per_node if a.ring_node_nics else 1
        seconds = max(seconds, (nodes - 1) / nodes * whole / (nics * cluster.inter_node_gbps * 1e9))
    return ring_latency(op, group, stride, cluster, a) + seconds / a.link_efficiency


def sharded_dp_exposed(units: int, params: float, work: float, cfg: ParallelConfig, cluster: ClusterSpec,
                       a: Assumptions) -> tuple[float, float]:
    """Exposed ZeRO-2/3 collectives on a rank holding ``params`` in ``units`` equal layers, each gathered and
    reduced as one FSDP unit, whose microbatch computes for ``work`` seconds: (per microbatch, once per step).

    ZeRO-3 all-gathers a unit's parameters before its forward and again before its backward, and every
    backward reduce-scatters its gradients; ZeRO-2 only the reduce-scatter (``zero_bytes``' ring bytes, over
    the d·cp ranks t apart: ``network.ring_time``). An engine that overlaps data-parallel traffic
    (``dp_overlap`` > 0) runs them on their own streams, prefetching the next unit's gather (torch FSDP2's
    implicit forward and backward prefetch, torch.distributed.fsdp.fully_shard; DeepSpeed ZeRO-3's prefetch
    bucket) and reducing a unit's gradients while the next unit computes: in the steady state a microbatch
    pays only what its collectives take beyond its compute, max(0, comm − compute), and each step the first
    gather (before any compute) and the last reduce-scatter (after all of it). Without overlap (Megatron
    2021) every collective is exposed, per microbatch.
    """
    d = cfg.grad_ranks
    if cfg.zero < 2 or d == 1:
        return 0.0, 0.0
    n = max(units, 1)
    scatter = dp_bytes_per_microbatch(params / n, d, 2, a.grad_bytes, a.param_bytes)  # a unit's reduce-scatter
    gathers = dp_bytes_per_microbatch(params / n, d, cfg.zero, a.grad_bytes, a.param_bytes) - scatter  # ZeRO-3: two
    rs = ring_time(scatter, "reduce_scatter", d, cfg.t, cluster, a)
    ag = ring_time(gathers / 2, "all_gather", d, cfg.t, cluster, a)
    comm = n * (2 * ag + rs)
    if a.dp_overlap == 0:
        return comm, 0.0
    return max(0.0, comm - work), ag + rs
