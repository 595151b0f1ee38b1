"""Pricing from a measured hardware profile: a layer's GEMM shapes and their measured throughput.

On a calibrated machine (``profiles.HardwareProfile.measured``) the planner's matmul efficiency is
not the fitted curve of ``assumptions.py`` but the profile's throughput at the layer's own GEMMs —
forward, input-gradient and weight-gradient shapes, FLOP-weighted — over the profile's peak, and a
collective costs the profile's fit for its op, group size and link.
``local.py`` prices the trainer's actions from the same shapes.
"""

from __future__ import annotations

from modelpar.costmodel.assumptions import Assumptions
from modelpar.costmodel.specs import ClusterSpec, ModelSpec, ParallelConfig

__all__ = ["collective_time", "gemm_efficiency", "layer_gemms"]


def layer_gemms(model: ModelSpec, tokens: int, t: int) -> list[tuple[int, int, int]]:
    """(m, n, k) of one layer's forward GEMMs on one of t ranks, x[m×k]·w[k×n]: QKV, output projection, MLP."""
    h, f, r = model.hidden, model.ffn_size, model.kv_fraction
    qkv = round((1 + 2 * r) * h / t)
    up = (2 if model.gated_mlp else 1) * f // t
    return [(tokens, qkv, h), (tokens, h, h // t), (tokens, up, h), (tokens, h, f // t)]


def gemm_efficiency(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig) -> float:
    """Measured throughput of a layer's GEMMs (forward, input gradient and weight gradient shapes),
    FLOP-weighted, over the profile's peak: what ``matmul_efficiency`` is on a calibrated machine."""
    profile = cluster.measured
    assert profile is not None
    flops = seconds = 0.0
    for m, n, k in layer_gemms(model, cfg.micro_batch * model.seq // cfg.cp, cfg.t):  # a cp rank: s/cp tokens
        for shape in ((m, n, k), (m, k, n), (k, n, m)):  # forward, dgrad, wgrad
            tflops = profile.matmul_tflops(*shape, ranks=cluster.ranks_per_node) or cluster.gpu.peak_tflops
            flops += 2.0 * m * n * k
            seconds += 2.0 * m * n * k / (tflops * 1e12)
    return min(1.0, flops / seconds / (cluster.gpu.peak_tflops * 1e12))


def collective_time(nbytes: float, gbps: float, a: Assumptions, cluster: ClusterSpec | None = None, op: str = "",
                group: int = 0, span: int = 0) -> float:
    """Time of a collective sending ``nbytes`` per rank: the measured profile's cost for (op, group, link)
    when it has one, else ``nbytes`` at ``link_efficiency`` of ``gbps`` plus ``collective_latency_s``."""
    profile = cluster.measured if cluster is not None else None
    if cluster is not None and profile is not None and op:
        cost = profile.collective(op, group, "intra" if cluster.link_name(span or group) == "nvlink" else "inter")
        if cost is not None:
            return cost.time(nbytes)
    return nbytes / (gbps * 1e9 * a.link_efficiency) + a.collective_latency_s
