"""Every assumption of the step-time and memory model, as one named, documented dataclass.

``REFERENCE`` is the reference text's own model (§6.2: matmuls at a flat 75% of peak, links at
their nominal bandwidth, nothing but matmuls timed, the embedding and output layer spread evenly
over stages, point-to-point hidden except in fill and drain, the gradient all-reduce counted as
(d − 1)/d of the gradients); it reproduces the text's 197 TFLOP/s, 78 GB and §6.3's 0.3%. ``DEFAULT`` adds what decides real
throughput, fitted once to published runs (``modelpar.costmodel.published``): a GEMM efficiency
curve, element-wise (memory-bound) work, achieved link bandwidth, per-kernel latency and the
output layer on the last stage. ``MODERN`` is ``DEFAULT`` with today's software (flash attention,
distributed optimizer, overlapped gradient all-reduce); ``assumptions_for`` picks by GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from modelpar._validate import check_number

__all__ = ["DEFAULT", "MODERN", "REFERENCE", "Assumptions", "assumptions_for"]


@dataclass(frozen=True)
class Assumptions:
    """Named knobs of the model; each field's comment says what it stands for and its source."""

    # --- compute ---------------------------------------------------------------------------
    matmul_efficiency: float | None = None  # flat fraction of peak for all matmuls; None = the curve below
    gemm_tokens_half: float = 256.0  # curve: tokens per microbatch (b·s) at which GEMMs reach half the GPU's ceiling
    gemm_width_half: float = 256.0  # curve: per-GPU width h/t at which GEMMs reach half the ceiling
    # HBM bytes moved per activation byte (Korthikanti's count) by LayerNorm, softmax, GeLU, dropout
    elementwise_passes: float = 2.0
    layer_latency_s: float = 60e-6  # fixed cost per layer per microbatch pass: kernel launches (§2.4's α)
    flash_attention: bool = False  # fused attention: no s² scores stored or streamed through HBM
    # --- communication ----------------------------------------------------------------------
    link_efficiency: float = 0.85  # fraction of nominal per-GPU bandwidth a collective reaches (NCCL bus bandwidth)
    collective_latency_s: float = 20e-6  # fixed cost of each collective / transfer
    # Megatron SC'21 §4.1: each of the t ranks sends 1/t over the network, then all-gathers on NVLink
    pp_scatter_gather: bool = True
    pp_overlap: float = 0.0  # fraction of steady-state point-to-point time hidden under compute (fill and drain always pay)
    # fixed cost per microbatch per pipeline chunk of the pipeline engine (DeepSpeed: see published.py)
    pp_engine_overhead_s: float = 0.0
    dp_overlap: float = 0.0  # fraction of the gradient all-reduce hidden under backward (0: Megatron 2021, after backward)
    grad_bytes: int = 2  # bytes per gradient element in the data-parallel all-reduce (16-bit)
    # --- memory -----------------------------------------------------------------------------
    state_bytes: float = 16.0  # mixed-precision Adam: 2 weight + 2 grad + 4 master + 4 + 4 moments (§1.1, ZeRO paper)
    sharded_state_bytes: float = 12.0  # of those, bytes a distributed optimizer (ZeRO-1) splits over d
    distributed_optimizer: bool = False  # shard the optimizer state over the data-parallel group
    memory_reserve_gb: float = 0.0  # per-GPU headroom for NCCL buffers, workspace, fragmentation
    memory_gib: bool = False  # read the GPU's memory_gb as GiB (2^30 B, what an "80 GB" card has); False: 1e9 B as the text
    # --- pipeline layout --------------------------------------------------------------------
    uniform_stages: bool = False  # spread embedding and output layer evenly over stages (the text's model)
    uneven_layers: bool = False  # allow p·v not dividing L: the busiest chunk gets ⌈L/(p·v)⌉ layers (DeepSpeed, Llama 3)

    def __post_init__(self) -> None:
        if self.matmul_efficiency is not None and not 0 < self.matmul_efficiency <= 1:
            raise ValueError(f"matmul_efficiency must be in (0, 1] or None, got {self.matmul_efficiency}")
        for name in ("gemm_tokens_half", "gemm_width_half", "elementwise_passes", "layer_latency_s", "pp_engine_overhead_s",
                     "collective_latency_s", "state_bytes", "sharded_state_bytes", "memory_reserve_gb"):
            check_number(name, getattr(self, name))
        if not 0 < check_number("link_efficiency", self.link_efficiency, strict=True) <= 1:
            raise ValueError(f"link_efficiency must be in (0, 1], got {self.link_efficiency}")
        for name in ("pp_overlap", "dp_overlap"):
            if not 0 <= check_number(name, getattr(self, name)) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.sharded_state_bytes > self.state_bytes:
            raise ValueError(
                f"sharded_state_bytes must be <= state_bytes ({self.state_bytes}), got {self.sharded_state_bytes}"
            )

    def memory_limit(self, memory_gb: float) -> float:
        """Bytes a GPU of ``memory_gb`` (its data-sheet number) offers."""
        return memory_gb * (2**30 if self.memory_gib else 1e9)

    def with_(self, **changes: object) -> Assumptions:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


DEFAULT = Assumptions()

REFERENCE = Assumptions(
    matmul_efficiency=0.75,
    elementwise_passes=0.0,
    layer_latency_s=0.0,
    link_efficiency=1.0,
    collective_latency_s=0.0,
    pp_overlap=1.0,  # transfers hide under other microbatches' compute except in fill and drain (§2.3)
    dp_overlap=0.5,  # the text counts (d − 1)/d·S per all-reduce, half of the ring's 2(d − 1)/d·S
    uniform_stages=True,
)

# The software H100/H200 clusters run (Megatron-Core, Llama 3's stack): fused (flash) attention,
# the distributed optimizer (ZeRO-1), and the gradient all-reduce overlapped with backward. BF16
# training keeps an FP32 gradient buffer (Megatron's --bf16 default), so the state is 2 + 4 + 12 = 18
# bytes per parameter, 6 + 12/d with the distributed optimizer (Megatron-Core's distrib_optimizer
# table). Capacity is the real one (80 GiB on an "80 GB" H100) less 1 GB for the CUDA context and NCCL.
MODERN = DEFAULT.with_(flash_attention=True, distributed_optimizer=True, dp_overlap=0.8,
                       state_bytes=18.0, sharded_state_bytes=12.0, memory_gib=True, memory_reserve_gb=1.0)


def assumptions_for(gpu_name: str) -> Assumptions:
    """``DEFAULT`` (Megatron-LM as in the published A100 runs) for A100s, ``MODERN`` for H100/H200 and later."""
    return DEFAULT if gpu_name.lower().startswith(("a100", "v100", "custom")) else MODERN
