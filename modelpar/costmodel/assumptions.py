"""Every assumption of the step-time and memory model, as one named, documented dataclass.

``REFERENCE`` is the reference text's own model (§6.2: matmuls at a flat 75% of peak, links at
their nominal bandwidth, nothing but matmuls timed, the embedding and output layer spread evenly
over equal stages, point-to-point hidden except in fill and drain, the gradient all-reduce counted as
(d − 1)/d of the gradients); it reproduces the text's 197 TFLOP/s, 78 GB and §6.3's "within 0.3%".
``DEFAULT`` adds what decides real throughput on A100s with Megatron-LM: a GEMM efficiency curve
(fitted on the published runs marked as the fit set, ``benchmarks/fit_costmodel.py``), element-wise
(memory-bound) work, achieved link bandwidth, per-kernel latency, the optimizer step and the output
layer on the last stage. ``MODERN`` is ``DEFAULT`` with today's H100 software (flash attention, fp32
gradients, overlapped gradient reduction); ``assumptions_for`` picks by GPU, ``engines`` sets the
fields each training engine decides.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from modelpar._validate import check_int, check_number

__all__ = ["DEFAULT", "DTYPE_BYTES", "MODERN", "REFERENCE", "Assumptions", "assumptions_for", "measured_assumptions"]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}


@dataclass(frozen=True)
class Assumptions:
    """Named knobs of the model; each field's comment says what it stands for and its source."""

    # --- compute ---------------------------------------------------------------------------
    matmul_efficiency: float | None = None  # flat fraction of peak for all matmuls; None = the curve below
    gemm_tokens_half: float = 192.0  # curve: tokens per microbatch (b·s) at which GEMMs reach half the GPU's ceiling
    gemm_width_half: float = 256.0  # curve: per-GPU width h/t at which GEMMs reach half the ceiling
    # HBM bytes moved per activation byte (Korthikanti's count) by LayerNorm, softmax, GeLU, dropout
    elementwise_passes: float = 2.0
    layer_latency_s: float = 80e-6  # fixed cost per layer per microbatch pass: kernel launches (§2.4's α)
    flash_attention: bool = False  # fused attention: no s² scores stored or streamed through HBM
    # --- communication ----------------------------------------------------------------------
    link_efficiency: float = 0.85  # fraction of nominal per-GPU bandwidth a collective reaches (NCCL bus bandwidth)
    collective_latency_s: float = 20e-6  # fixed cost of each collective / transfer
    # a data-parallel ring also pays NCCL's per-step hop latency (NVLink or network: ``network.ring_latency``)
    ring_hop_latency: bool = True
    # a ring over g members per node reaches g NICs' bandwidth across nodes (NCCL's one channel per NIC; nccl-tests'
    # multi-node bus bandwidth near the node's NICs together); False: each member's own NIC (``network.ring_time``)
    ring_node_nics: bool = False
    # fraction of the backward's hideable tensor-parallel collectives hidden under the weight-gradient GEMMs
    tp_overlap: float = 1.0
    # sequence parallelism keeps 1/t of each first linear's input and all-gathers it again for the weight gradient
    # (Megatron-LM, Korthikanti §4.2.2); False: the gathered input is what autograd saves (PyTorch DTensor's
    # SequenceParallel / ColwiseParallel: the all-gather's output is the Linear's saved input), no second gather
    sp_regather: bool = True
    # with sequence parallelism, each all-gather / reduce-scatter split into t chunks pipelined with its GEMM
    # (Megatron-Core --tp-comm-overlap, PyTorch asynchronous TP): ``estimate.tp_overlapped``
    tp_comm_overlap: bool = False
    # Megatron SC'21 §4.1: each of the t ranks sends 1/t over the network, then all-gathers on NVLink
    pp_scatter_gather: bool = True
    pp_overlap: float = 0.0  # fraction of steady-state point-to-point time hidden under compute (fill and drain always pay)
    # fixed cost per microbatch per pipeline chunk of the pipeline engine (DeepSpeed: see engines.py)
    pp_engine_overhead_s: float = 0.0
    interleaving: bool = True  # the engine has Megatron's interleaved 1F1B (v > 1 chunks per device)
    # fraction of data-parallel traffic hidden under compute: the end-of-step gradient reduction under the
    # last backward, ZeRO-2/3's per-microbatch collectives under that microbatch (0: Megatron 2021, after backward)
    dp_overlap: float = 0.0
    optimizer_step: bool = True  # time the optimizer step: one memory-bound pass over this rank's state
    # add each microbatch's weight gradients into the accumulated ones in a separate memory-bound pass
    # (Megatron-LM 2021's main_grad hook, autograd's +=); False: fused into the weight-gradient GEMM
    grad_accumulation_pass: bool = False
    # --- memory -----------------------------------------------------------------------------
    param_bytes: int = 2  # bytes per parameter as the layers use it (16-bit)
    grad_bytes: int = 2  # bytes per gradient element, kept and reduced over d (16-bit; Megatron's BF16 path: 4)
    memory_reserve_gb: float = 0.0  # per-GPU headroom for NCCL buffers, workspace, fragmentation
    memory_gib: bool = False  # read the GPU's memory_gb as GiB (2^30 B, what an "80 GB" card has); False: 1e9 B as the text
    # --- pipeline layout --------------------------------------------------------------------
    uniform_stages: bool = False  # spread embedding and output layer evenly over stages (the text's model)
    engine: str = "megatron"  # the training engine these assumptions describe (``modelpar.costmodel.engines``)

    def __post_init__(self) -> None:
        if self.matmul_efficiency is not None and not 0 < self.matmul_efficiency <= 1:
            raise ValueError(f"matmul_efficiency must be in (0, 1] or None, got {self.matmul_efficiency}")
        for name in ("gemm_tokens_half", "gemm_width_half", "elementwise_passes", "layer_latency_s", "pp_engine_overhead_s",
                     "collective_latency_s", "memory_reserve_gb"):
            check_number(name, getattr(self, name))
        if not 0 < check_number("link_efficiency", self.link_efficiency, strict=True) <= 1:
            raise ValueError(f"link_efficiency must be in (0, 1], got {self.link_efficiency}")
        for name in ("tp_overlap", "pp_overlap", "dp_overlap"):
            if not 0 <= check_number(name, getattr(self, name)) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        check_int("param_bytes", self.param_bytes, minimum=1)
        check_int("grad_bytes", self.grad_bytes, minimum=1)

    def memory_limit(self, memory_gb: float) -> float:
        """Bytes a GPU of ``memory_gb`` (its data-sheet number) offers."""
        return memory_gb * (2**30 if self.memory_gib else 1e9)

    def with_(self, **changes: Any) -> Assumptions:
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
    optimizer_step=False,  # nothing but matmuls is timed
    tp_overlap=0.0,  # 4 all-reduces per layer, 6 with recomputation (§5.4, §6.2)
    ring_hop_latency=False,
    uniform_stages=True,
    engine="reference",
)

# The software H100/H200 clusters run (Megatron-Core, Llama 3's stack): fused (flash) attention and
# the gradient reduction overlapped with backward. BF16 training keeps and reduces FP32 gradients
# (Megatron's --bf16 default, Llama 3 §3.3.4), so the state is 2 + 4 + 12 = 18 bytes per parameter,
# 6 + 12/d with the distributed optimizer (ZeRO-1, Megatron-Core's distrib_optimizer table). Capacity
# is the real one (80 GiB on an "80 GB" H100) less 1 GB for the CUDA context and NCCL.
MODERN = DEFAULT.with_(flash_attention=True, dp_overlap=0.8, grad_bytes=4, memory_gib=True, memory_reserve_gb=1.0)


def assumptions_for(gpu_name: str) -> Assumptions:
    """``DEFAULT`` (Megatron-LM as in the published A100 runs) for A100s, ``MODERN`` for H100/H200 and later."""
    return DEFAULT if gpu_name.lower().startswith(("a100", "v100", "custom")) else MODERN


def measured_assumptions(dtype: str, op_latency_s: float | None, ops_per_layer_pass: float = 12.0) -> Assumptions:
    """``DEFAULT`` on a calibrated machine: weights, gradients and activations in ``dtype`` (no mixed
    precision), no fused attention, no overlapped data-parallel reduction; the measured per-op latency
    × ``ops_per_layer_pass`` (norms, projections, attention, activation, residuals) per layer pass."""
    size = DTYPE_BYTES[dtype]
    latency = DEFAULT.layer_latency_s if op_latency_s is None else op_latency_s * ops_per_layer_pass
    return DEFAULT.with_(param_bytes=size, grad_bytes=size, layer_latency_s=latency, engine="megatron")
