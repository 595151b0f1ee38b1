"""Training engines: the named overheads and limits each one brings to the cost model (``--engine``).

An engine is a name, one sentence saying what the model assumes about it (the planner's
explanation prints it) and the ``Assumptions`` fields it sets. Add one by adding an entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from modelpar.costmodel.assumptions import Assumptions

__all__ = ["ENGINES", "Engine", "engine_assumptions"]


@dataclass(frozen=True)
class Engine:
    """A training engine: what the cost model assumes about it, in words and as ``Assumptions`` fields."""

    name: str
    summary: str
    overrides: dict[str, Any] = field(default_factory=dict)


def _engine(*, overlap_tp: bool, accumulation_pass: bool, scatter_gather: bool, interleaving: bool,
            overhead_s: float = 0.0, sp_regather: bool = True, comm_gemm_overlap: bool = False) -> dict[str, Any]:
    """Every field an engine decides, so that applying one engine fully replaces another's."""
    return dict(tp_overlap=1.0 if overlap_tp else 0.0, grad_accumulation_pass=accumulation_pass,
                pp_scatter_gather=scatter_gather, pp_engine_overhead_s=overhead_s, interleaving=interleaving,
                sp_regather=sp_regather, tp_comm_overlap=comm_gemm_overlap)


ENGINES: dict[str, Engine] = {
    # Megatron-LM since 2022 (the code of Korthikanti et al. 2022, LinearWithGradAccumulationAndAsyncCommunication):
    # the backward's input-gradient all-reduce / reduce-scatter is launched asynchronously and overlaps
    # the weight-gradient GEMM, which accumulates straight into the fp32 gradient buffer.
    "megatron": Engine(
        "megatron",
        "Megatron-LM (2022 on): 1F1B or interleaved 1F1B, pipeline activations scattered over the t ranks and "
        "gathered on NVLink (SC'21 §4.1), blocking point-to-point, the backward's tensor-parallel collectives "
        "overlapping the weight-gradient GEMMs, which accumulate straight into the gradient buffer",
        _engine(overlap_tp=True, accumulation_pass=False, scatter_gather=True, interleaving=True),
    ),
    # Megatron-LM as in SC'21 (§4.2 lists its kernel fusions; neither of the above): synchronous all-reduces,
    # and each microbatch's gradients added to main_grad by a backward hook, a pass over the weights.
    "megatron-2021": Engine(
        "megatron-2021",
        "Megatron-LM as in SC'21: like megatron, but the backward's tensor-parallel all-reduces are synchronous "
        "and each microbatch's gradients are added to the accumulated ones in a separate memory pass",
        _engine(overlap_tp=False, accumulation_pass=True, scatter_gather=True, interleaving=True),
    ),
    # MT-NLG (Smith et al. 2022 §3.2) and BLOOM ran DeepSpeed's pipeline engine with Megatron's tensor
    # parallelism of 2021: every TP rank sends the whole activation, the schedule is plain 1F1B, and each
    # microbatch pays a fixed cost per pipeline chunk (blocking send/recv, per-instruction dispatch),
    # 30 ms, fitted once to MT-NLG's three runs (published.py) and checked on BLOOM, which it was not fitted on.
    "deepspeed": Engine(
        "deepspeed",
        "DeepSpeed pipeline engine: plain 1F1B (no interleaving), every tensor-parallel rank sends the whole "
        "activation, synchronous tensor-parallel all-reduces, gradients accumulated in a separate pass, "
        "30 ms per microbatch per stage of engine overhead (fitted on MT-NLG)",
        _engine(overlap_tp=False, accumulation_pass=True, scatter_gather=False, interleaving=False, overhead_s=0.03),
    ),
    # Dubey et al. 2024 §3.3 describe Llama 3's stack as PyTorch with FSDP, tensor, pipeline and context
    # parallelism; torchtitan is the public stack of that design. Its tensor-parallel collectives are
    # synchronous (asynchronous TP is opt-in there), its pipeline sends whole activations, and FSDP
    # reduces gradients as they are produced. DTensor's sequence parallelism saves the all-gathered input of
    # each first linear for its weight gradient (no second all-gather in the backward, as Megatron does).
    "pytorch": Engine(
        "pytorch",
        "PyTorch-native stack (FSDP + DTensor tensor parallelism + pipelining, as torchtitan and Llama 3's): "
        "1F1B or interleaved 1F1B, synchronous tensor-parallel collectives, whole activations between stages",
        _engine(overlap_tp=False, accumulation_pass=False, scatter_gather=False, interleaving=True, sp_regather=False),
    ),
    # Megatron-Core with TransformerEngine's userbuffers (--tp-comm-overlap; NeMo's H100 recipes turn it on):
    # with sequence parallelism every tensor-parallel all-gather and reduce-scatter is split into chunks pipelined
    # with the GEMM beside it (estimate.tp_overlapped); otherwise as megatron.
    "megatron-core": Engine(
        "megatron-core",
        "Megatron-Core with --tp-comm-overlap: as megatron, and with sequence parallelism each tensor-parallel "
        "all-gather and reduce-scatter pipelined in t chunks with its GEMM (userbuffers)",
        _engine(overlap_tp=True, accumulation_pass=False, scatter_gather=True, interleaving=True, comm_gemm_overlap=True),
    ),
    # torchtitan with asynchronous tensor parallelism (torch.distributed._symmetric_memory's fused all-gather-matmul
    # and matmul-reduce-scatter, opt-in): the pytorch engine with its SP collectives pipelined with their GEMMs.
    "pytorch-async-tp": Engine(
        "pytorch-async-tp",
        "PyTorch-native stack with asynchronous tensor parallelism: as pytorch, and with sequence parallelism each "
        "tensor-parallel all-gather and reduce-scatter pipelined in t chunks with its GEMM",
        _engine(overlap_tp=False, accumulation_pass=False, scatter_gather=False, interleaving=True, sp_regather=False,
                comm_gemm_overlap=True),
    ),
}


def engine_assumptions(base: Assumptions, name: str) -> Assumptions:
    """``base`` with engine ``name``'s fields set; ValueError for an unknown engine."""
    key = name.strip().lower()
    if key not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
    return base.with_(engine=key, **ENGINES[key].overrides)
