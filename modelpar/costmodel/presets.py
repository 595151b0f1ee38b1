"""Named models and GPU nodes, with where their numbers come from.

Models: GPT-3 175B (Brown et al. 2020, as Megatron trains it: V padded to 51200), the 1T model of
Megatron SC'21 Table 1 (the reference's §6.2), BLOOM-176B, OPT-175B and Llama-3 8B/70B/405B
(their model cards), and two mixtures of experts: Mixtral 8x7B (Jiang et al. 2024, arXiv:2401.04088,
Table 1) and DeepSeek-V3 (DeepSeek-AI 2024, arXiv:2412.19437, §4.2 and its config.json) — their shape
figures entered from memory of those sources, not re-read (docs/costmodel.md marks them); DeepSeek-V3's
multi-head latent attention is modelled as plain attention of 128 heads over h (not modelled: MLA,
FP8, multi-token prediction). Nodes: DGX-style 8-GPU boxes, per-GPU NVLink bandwidth in one direction
and one 200 Gb/s (A100) or 400 Gb/s (H100/H200/H800) InfiniBand NIC per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from modelpar.costmodel.moe import MoESpec
from modelpar.costmodel.profiles import HardwareProfile, node_profile
from modelpar.costmodel.specs import ClusterSpec, GPUSpec, ModelSpec

__all__ = ["CPU_DEFAULT", "GPUS", "MODELS", "PROFILES", "NodePreset", "gpu_preset", "make_cluster", "model_preset",
           "profile_node"]

_LLAMA: dict[str, Any] = dict(kv_heads=8, gated_mlp=True, tied_embeddings=False, learned_positions=False, bias=False,
                              dropout=False)

MODELS: dict[str, ModelSpec] = {
    "gpt3-175b": ModelSpec(96, 12288, 96, 2048, 51200, name="gpt3-175b"),
    "megatron-1t": ModelSpec(128, 25600, 160, 2048, 51200, name="megatron-1t"),
    "bloom-176b": ModelSpec(70, 14336, 112, 2048, 250880, learned_positions=False, name="bloom-176b"),
    "opt-175b": ModelSpec(96, 12288, 96, 2048, 50272, name="opt-175b"),
    "llama3-8b": ModelSpec(32, 4096, 32, 8192, 128256, ffn=14336, name="llama3-8b", **_LLAMA),
    "llama3-70b": ModelSpec(80, 8192, 64, 8192, 128256, ffn=28672, name="llama3-70b", **_LLAMA),
    "llama3-405b": ModelSpec(126, 16384, 128, 8192, 128256, ffn=53248, name="llama3-405b", **_LLAMA),
    # from memory: h 4096, 32 layers, 32 heads, 8 kv heads, 8 experts of 14336, top-2, V 32000, s 4096 (46.7B / 12.9B)
    "mixtral-8x7b": ModelSpec(32, 4096, 32, 4096, 32000, ffn=14336, name="mixtral-8x7b",
                              moe=MoESpec(8, 14336, top_k=2), **_LLAMA),
    # from memory (config.json): 61 layers, h 7168, 128 heads, the first 3 dense (FFN 18432), then 256 routed experts
    # of 2048 + 1 shared, top-8, sigmoid router, V 129280, pre-training s 4096; MLA as plain multi-head attention
    "deepseek-v3": ModelSpec(61, 7168, 128, 4096, 129280, ffn=18432, name="deepseek-v3",
                             moe=MoESpec(256, 2048, shared=1, top_k=8, router="sigmoid", first_dense=3),
                             **{**_LLAMA, "kv_heads": 0}),
}


@dataclass(frozen=True)
class NodePreset:
    """A GPU and the node it usually comes in (or a measured machine: ``profile`` then holds its numbers)."""

    gpu: GPUSpec
    gpus_per_node: int
    intra_node_gbps: float  # NVLink, GB/s per GPU per direction
    inter_node_gbps: float  # InfiniBand, GB/s per GPU
    profile: HardwareProfile | None = None  # the hardware profile it was made from


# The named GPU nodes are hardware profiles of the data-sheet kind (no measured points), the same form
# `modelpar calibrate` writes; `modelpar plan --gpu NAME` and `--hardware FILE` read them alike.
PROFILES: dict[str, HardwareProfile] = {
    # A100 SXM: 312 TFLOP/s BF16 dense, 2.0 TB/s HBM2e, NVLink3 600 GB/s bidirectional, HDR 200 Gb/s.
    "a100-80gb": node_profile("a100-80gb", 312.0, 80.0, 2.039, 0.82, 8, 300.0, 25.0),
    "a100-40gb": node_profile("a100-40gb", 312.0, 40.0, 1.555, 0.82, 8, 300.0, 25.0),
    # H100 SXM: 989 TFLOP/s BF16 dense, 3.35 TB/s HBM3, NVLink4 900 GB/s bidirectional, NDR 400 Gb/s.
    "h100-sxm": node_profile("h100-sxm", 989.0, 80.0, 3.35, 0.72, 8, 450.0, 50.0),
    # H200: the H100 die with 141 GB of HBM3e at 4.8 TB/s.
    "h200": node_profile("h200", 989.0, 141.0, 4.8, 0.72, 8, 450.0, 50.0),
    # H800 (the export variant DeepSeek-V3 trained on): H100 SXM compute and memory, NVLink cut to 400 GB/s
    # bidirectional (200 per direction), 400 Gb/s InfiniBand per GPU (DeepSeek-V3 §3.1: 8 NICs per node).
    "h800": node_profile("h800", 989.0, 80.0, 3.35, 0.72, 8, 200.0, 50.0),
}
# Host links (activation offload): PCIe 4.0 x16 on A100 nodes, 5.0 x16 on H100/H200/H800, ~80% of the 32 / 64 GB/s
# per direction a copy from pinned memory reaches.
_HOST_GBPS = {"a100-80gb": 25.0, "a100-40gb": 25.0, "h100-sxm": 50.0, "h200": 50.0, "h800": 50.0}
PROFILES = {name: replace(profile, host_gbps=_HOST_GBPS[name]) for name, profile in PROFILES.items()}


def profile_node(profile: HardwareProfile) -> NodePreset:
    """The node a hardware profile describes: its GPU spec (peak of the profile's dtype), node size and links."""
    gpu = GPUSpec(profile.name, profile.peak_tflops[profile.dtype], profile.memory_gb, profile.hbm_tb_s,
                  profile.matmul_ceiling)
    return NodePreset(gpu, profile.devices_per_node, profile.intra_node_gbps, profile.inter_node_gbps, profile)


GPUS: dict[str, NodePreset] = {name: profile_node(profile) for name, profile in PROFILES.items()}

# What `modelpar train` predicts with when no --hardware profile is given: nominal round numbers for one
# core of a small x86 machine running gloo (not a measurement; `modelpar calibrate` replaces it).
CPU_DEFAULT = HardwareProfile(
    name="cpu-default", device="cpu", backend="gloo", memory_gb=8.0, devices_per_node=64, peak_tflops={"fp32": 0.05},
    intra_node_gbps=1.0, inter_node_gbps=1.0, hbm_tb_s=0.005, host="nominal", matmul={"fp32": {"1": [[256, 256, 256, 0.05]]}},
    attention={"fp32": {"1": 0.005}}, elementwise_gbps={"1": 5.0}, op_latency_s={"1": 2e-5},
    collectives={op: {"intra": {"2": [1e-4, 1.0]}} for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p")})


def _lookup(kind: str, table: dict, name: str):
    key = name.strip().lower()
    if key not in table:
        raise ValueError(f"unknown {kind} preset {name!r}; known: {', '.join(table)}")
    return table[key]


def model_preset(name: str) -> ModelSpec:
    """The model called ``name`` (case-insensitive); ValueError lists the known ones."""
    return _lookup("model", MODELS, name)


def gpu_preset(name: str) -> NodePreset:
    """The GPU node called ``name``; ValueError lists the known ones."""
    return _lookup("gpu", GPUS, name)


def make_cluster(gpu: str | NodePreset, gpus: int, gpus_per_node: int | None = None,
                 intra_node_gbps: float | None = None, inter_node_gbps: float | None = None) -> ClusterSpec:
    """A cluster of ``gpus`` GPUs in preset nodes; the other arguments, when given, replace the node's numbers."""
    node = gpu_preset(gpu) if isinstance(gpu, str) else gpu
    return ClusterSpec(
        node.gpu, gpus,
        node.gpus_per_node if gpus_per_node is None else gpus_per_node,
        node.intra_node_gbps if intra_node_gbps is None else intra_node_gbps,
        node.inter_node_gbps if inter_node_gbps is None else inter_node_gbps,
        node.profile,
    )
