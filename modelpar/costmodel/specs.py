"""Validated specs for the cost model: the model, the GPU, the cluster and one parallel configuration.

Every number is a named field with its unit; bad values raise ``ValueError`` naming the field
(``modelpar._validate``). The parameter count and per-token FLOPs generalise Megatron's GPT
formulas (SC'21 appendix) to a given FFN width, grouped-query attention and gated (SwiGLU) MLPs;
for a GPT (ffn = 4h, no GQA) they reduce to them exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property

from modelpar._validate import check_choice, check_divisible, check_int, check_number
from modelpar.costmodel.moe import MoESpec, active_moe_layer_params, moe_layer_params
from modelpar.costmodel.profiles import HardwareProfile
from modelpar.costmodel.zero_bytes import ZERO_STAGES

__all__ = ["CP_COMMS", "PLANNED_RECOMPUTE", "ClusterSpec", "Dimensions", "GPUSpec", "ModelSpec", "ParallelConfig",
           "RankGrid", "check_context_split", "check_trainer_context", "context_split_reason"]

# The recomputation strategies the planner models: the names of modelpar.recompute.RECOMPUTE_NAMES
# that Megatron runs and Korthikanti et al. measured (every-k and recompute-all are not searched).
PLANNED_RECOMPUTE = ("none", "selective", "full")
CP_COMMS = ("ring", "allgather")  # the trainer's --cp-comm choices (modelpar.tensor_parallel.context_parallel)


def context_split_reason(seq_len: int, cp: int) -> str | None:
    """Why ``seq_len`` does not split into 2·cp equal chunks (the load-balanced split; no padding), or None."""
    check_int("cp", cp, minimum=1)
    if cp > 1 and seq_len % (2 * cp):
        return (f"seq_len ({seq_len}) must be divisible by 2 * cp ({2 * cp}): context parallelism "
                f"splits every sequence into 2·cp equal chunks (no padding)")
    return None


def check_context_split(seq_len: int, cp: int) -> None:
    """ValueError unless ``seq_len`` splits into 2·cp equal chunks (``context_split_reason``)."""
    reason = context_split_reason(seq_len, cp)
    if reason is not None:
        raise ValueError(reason)


def check_trainer_context(seq_len: int, cp: int, zero: int, tp: int, sequence_parallel: bool) -> None:
    """ValueError unless ``modelpar train`` runs context parallelism ``cp`` with these settings: the 2·cp split
    (``check_context_split``), ZeRO 0 or 1 when cp > 1 (ZeRO-2/3 with cp are not tested), and under sequence
    parallelism s/cp tokens that split over t. The trainer's ``TrainConfig.check`` and its planner both ask here."""
    check_context_split(seq_len, cp)
    if cp > 1 and zero >= 2:
        raise ValueError(f"zero {zero} with cp {cp} is not supported (ZeRO-1 is: its state is sharded "
                         "over the d·cp ranks); use zero 0 or 1 with context parallelism")
    if sequence_parallel and cp > 1:
        check_divisible("seq_len / cp (sequence parallel)", seq_len // cp, "tp", tp)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer."""

    layers: int  # number of transformer layers, L
    hidden: int  # model width, h
    heads: int  # attention heads, a
    seq: int  # sequence length in tokens, s
    vocab: int  # vocabulary size, V (Megatron pads it to a multiple of 128·t)
    ffn: int = 0  # MLP width; 0 means 4h
    kv_heads: int = 0  # key/value heads (grouped-query attention); 0 means = heads
    gated_mlp: bool = False  # SwiGLU: three h×ffn matrices instead of two
    tied_embeddings: bool = True  # output layer shares the input embedding
    learned_positions: bool = True  # s×h position embedding (GPT); False for RoPE / ALiBi
    bias: bool = True  # biases and LayerNorm β (GPT); False for Llama-style RMSNorm, no biases
    dropout: bool = True  # dropout after attention and MLP (GPT, 1-byte masks); False for Llama-style models
    name: str = "custom"
    moe: MoESpec | None = None  # mixture of experts in place of the MLP of ``moe.layers`` (costmodel.moe); None: dense

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("ffn", self.ffn, minimum=0)
        check_int("kv_heads", self.kv_heads, minimum=0)
        check_divisible("hidden", self.hidden, "heads", self.heads)
        if self.kv_heads:
            check_divisible("heads", self.heads, "kv_heads", self.kv_heads)

    @cached_property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @cached_property
    def kv_fraction(self) -> float:
        """kv_heads / heads: 1 for multi-head attention, 1/8 for Llama-3's grouped-query attention."""
        return (self.kv_heads or self.heads) / self.heads

    @cached_property
    def layer_matmul_params(self) -> float:
        """Weights of one layer's matrices: Q and O are h×h, K and V h×(r·h), the MLP 2 or 3 of h×ffn."""
        h, f = self.hidden, self.ffn_size
        return (2 + 2 * self.kv_fraction) * h * h + (3 if self.gated_mlp else 2) * h * f

    @cached_property
    def layer_params(self) -> float:
        """One layer: matrices plus biases and norms (13h for a GPT, SC'21 eq. 2; 2h for RMSNorm only); with
        experts the average over the layers (a MoE layer: router and every expert in place of the MLP)."""
        h = self.hidden
        small = (7 + 2 * self.kv_fraction) * h + self.ffn_size if self.bias else 2 * h
        moe = 0.0
        if self.moe is not None:
            e = self.moe
            moe = self.moe_share * (moe_layer_params(h, e.experts, e.ffn, e.shared) - self._mlp_params)
        return self.layer_matmul_params + small + moe

    @cached_property
    def _mlp_params(self) -> float:
        return (3 if self.gated_mlp else 2) * self.hidden * self.ffn_size

    @cached_property
    def moe_share(self) -> float:
        """Share of the layers that are mixtures of experts (0 for a dense model)."""
        return len(self.moe.layers(self.layers)) / self.layers if self.moe is not None else 0.0

    @cached_property
    def expert_flops_per_token(self) -> float:
        """Forward FLOPs per token and layer (averaged) of the router and the k routed experts a token uses
        (× the kept share): the part every tensor-parallel rank computes whole (the trainer's layout)."""
        if self.moe is None:
            return 0.0
        e = self.moe
        return self.moe_share * 2 * self.hidden * (e.experts + 3 * e.ffn * e.top_k * e.kept)

    @cached_property
    def embedding_params(self) -> float:
        """Input embedding, output layer when untied and learned positions (the final norm, 2h, is left out as in SC'21 eq. 2)."""
        h = self.hidden
        emb = self.vocab * h * (1 if self.tied_embeddings else 2)
        return emb + (self.seq * h if self.learned_positions else 0)

    @cached_property
    def params(self) -> float:
        """Total parameter count P (GPT: 12·L·h²·(1 + 13/(12h) + (V + s)/(12·L·h)), SC'21 eq. 2)."""
        return self.layers * self.layer_params + self.embedding_params

    @cached_property
    def layer_flops_per_token(self) -> float:
        """Forward FLOPs of one layer per token: 2 per weight plus 4·s·h for QKᵀ and attention·V.

        No causal halving, as Megatron counts. With experts the average over the layers: a MoE layer's
        router, k·(kept share) routed and S shared experts in place of the MLP.
        """
        moe = 0.0
        if self.moe is not None:
            e = self.moe
            active: float = active_moe_layer_params(self.hidden, e.experts, e.top_k, e.ffn, e.shared)
            active -= 3 * self.hidden * e.ffn * e.top_k * (1 - e.kept)  # dropped assignments compute nothing
            moe = self.moe_share * 2 * (active - self._mlp_params)
        return 2 * self.layer_matmul_params + 4 * self.seq * self.hidden + moe

    @cached_property
    def logits_flops_per_token(self) -> float:
        """Forward FLOPs of the output layer per token, 2·h·V."""
        return 2 * self.hidden * self.vocab

    def model_flops(self, tokens: float) -> float:
        """Model FLOPs (forward + backward = 3 × forward, no recomputation) for ``tokens`` tokens: the MFU numerator."""
        return 3 * tokens * (self.layers * self.layer_flops_per_token + self.logits_flops_per_token)

    @cached_property
    def act_sharded_coeff(self) -> float:
        """Korthikanti (2022) §4.1: bytes/(s·b·h) of a layer's activations that tensor parallelism splits (24 for a GPT).

        Q 2, K and V 2r each (r = kv_fraction), attention output 2 (the output projection's input; sum 8 for
        a GPT) plus the MLP: 2·ffn/h for the activation input, 2·ffn/h for the second matrix's input, and
        2·ffn/h more for the gate of a SwiGLU (16 for a GPT). The s² attention terms are separate
        (``activation_bytes_per_layer``). Derivation: docs/costmodel.md, "Activation memory".
        """
        return 4 + 4 * self.kv_fraction + (6 if self.gated_mlp else 4) * self.ffn_size / self.hidden

    @cached_property
    def act_replicated_coeff(self) -> float:
        """Korthikanti (2022) §4.1: bytes/(s·b·h) tensor parallelism leaves whole (sequence parallelism splits them).

        The two norm inputs 2 + 2, the QKV and first MLP matrix inputs 2 + 2, and with dropout the two
        1-byte masks 1 + 1: 10 for a GPT, 8 for Llama (RMSNorm keeps its input too; no dropout).
        """
        return 8.0 + (2.0 if self.dropout else 0.0)


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator: dense 16-bit peak, memory, memory bandwidth and the best matmul efficiency it reaches."""

    name: str
    peak_tflops: float  # dense BF16/FP16 tensor-core peak, TFLOP/s
    memory_gb: float  # HBM capacity, GB (1e9 bytes)
    hbm_tb_s: float = 2.0  # HBM bandwidth, TB/s: times the element-wise (non-matmul) work
    matmul_efficiency: float = 0.8  # fraction of peak a large, well-shaped GEMM reaches (the curve's ceiling)

    def __post_init__(self) -> None:
        check_number("peak_tflops", self.peak_tflops, strict=True)
        check_number("memory_gb", self.memory_gb, strict=True)
        check_number("hbm_tb_s", self.hbm_tb_s, strict=True)
        if not 0 < check_number("matmul_efficiency", self.matmul_efficiency, strict=True) <= 1:
            raise ValueError(f"matmul_efficiency must be in (0, 1], got {self.matmul_efficiency}")


@dataclass(frozen=True)
class ClusterSpec:
    """``gpus`` identical GPUs in nodes of ``gpus_per_node``; bandwidths are GB/s per GPU, one direction (§1.3)."""

    gpu: GPUSpec
    gpus: int
    gpus_per_node: int = 8
    intra_node_gbps: float = 300.0  # NVLink/NVSwitch, GB/s per GPU
    inter_node_gbps: float = 25.0  # InfiniBand, GB/s per GPU (one NIC per GPU)
    # the hardware profile behind the numbers; a measured one also prices GEMMs and collectives (estimate.py)
    profile: HardwareProfile | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_int("gpus", self.gpus, minimum=1)
        check_int("gpus_per_node", self.gpus_per_node, minimum=1)
        check_number("intra_node_gbps", self.intra_node_gbps, strict=True)
        check_number("inter_node_gbps", self.inter_node_gbps, strict=True)

    def link_name(self, span: int) -> str:
        """The link a collective over ``span`` consecutive ranks crosses: "nvlink" inside a node, else "network"."""
        return "nvlink" if span <= self.gpus_per_node else "network"

    @property
    def measured(self) -> HardwareProfile | None:
        """The profile when it holds measured numbers (``modelpar calibrate``), else None."""
        return self.profile if self.profile is not None and self.profile.measured else None

    @property
    def ranks_per_node(self) -> int:
        """Processes sharing a node's compute (a CPU's cores): the node, or all of them if fewer."""
        return min(self.gpus, self.gpus_per_node)

    def link_gbps(self, span: int) -> float:
        """Bandwidth of a collective over ``span`` consecutive ranks: NVLink inside a node, else the inter-node link."""
        return self.intra_node_gbps if span <= self.gpus_per_node else self.inter_node_gbps


class RankGrid:
    """The rank counts of a (t, cp, p, d) layout and its p·v stages, for the dataclasses that hold one
    (``ParallelConfig``, ``LocalLayout``)."""

    t: int
    cp: int
    p: int
    d: int
    v: int  # stages per pipeline rank

    @property
    def stages(self) -> int:
        """The pipeline's stages, p·v."""
        return self.p * self.v

    @property
    def world(self) -> int:
        """All the ranks: t·cp·p·d (docs/notation.md, the rank grid)."""
        return self.t * self.cp * self.p * self.d

    @property
    def grad_ranks(self) -> int:
        """The ranks holding the same parameters, over which gradients are averaged and ZeRO shards: d·cp
        (cp joins data parallelism)."""
        return self.d * self.cp


@dataclass(frozen=True, kw_only=True)
class Dimensions(RankGrid):
    """The layout fields both layout records hold (``ParallelConfig``, ``LocalLayout``), declared and checked once:
    the dimensions beyond t, p, d and the stage split. Keyword-only, so each record keeps its own positional
    fields; a new parallel dimension's field goes here (docs/architecture.md, "a parallel dimension")."""

    cp: int = 1  # context-parallel ranks: each sequence split across them, s/cp tokens a rank (docs/context_parallel.md)
    cp_comm: str = "ring"  # how attention sees the whole sequence: "ring" (overlapped) or "allgather" (``costmodel.context``)
    ep: int = 1  # expert-parallel ranks, folded into d (ep | d): each holds E/ep of every MoE layer's experts
    # layers of each of the p·v stages in pipeline order (stage k on device k mod p; ``--stage-layers``); None = ``split_layers``
    stage_layers: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        """The record's own fields first (t, p, d, …), then these: as the record is written."""
        names = [f.name for f in fields(self) if not f.kw_only] + [f.name for f in fields(self) if f.kw_only]
        return f"{type(self).__name__}({', '.join(f'{n}={getattr(self, n)!r}' for n in names)})"

    def __post_init__(self) -> None:
        for name in ("cp", "ep"):
            check_int(name, getattr(self, name), minimum=1)
        check_choice("cp_comm", self.cp_comm, CP_COMMS)
        if self.stage_layers is not None:
            if len(self.stage_layers) != self.stages:
                raise ValueError(f"stage_layers has {len(self.stage_layers)} entries, expected p·v = {self.stages}")
            for n in self.stage_layers:
                check_int("stage_layers entries", n, minimum=0)


@dataclass(frozen=True, repr=False)  # Dimensions.__repr__: t, p, d first
class ParallelConfig(Dimensions):
    """One layout (Megatron notation): t-way tensor, cp-way context, p-way pipeline with v chunks per device, d-way data."""

    t: int
    p: int
    d: int
    micro_batch: int = 1  # sequences per microbatch, b
    v: int = 1  # model chunks per device (interleaved 1F1B); 1 = plain 1F1B
    recompute: str = "full"  # activation recomputation: none, selective (Korthikanti) or full
    sequence_parallel: bool = False  # split LayerNorm/dropout activations along the sequence (needs t > 1)
    zero: int = 0  # ZeRO stage over the d replicas: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters (FSDP)
    # cp, cp_comm, ep and stage_layers: ``Dimensions``'s, keyword-only

    def __post_init__(self) -> None:
        for name in ("t", "p", "d", "micro_batch", "v"):
            check_int(name, getattr(self, name), minimum=1)
        check_choice("recompute", self.recompute, PLANNED_RECOMPUTE)
        check_choice("zero", self.zero, ZERO_STAGES)
        super().__post_init__()

    @property
    def gpus(self) -> int:
        """The GPUs the layout needs (its ``world``)."""
        return self.world
