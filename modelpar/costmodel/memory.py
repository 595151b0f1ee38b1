"""Memory per GPU: training state (ZeRO stage 0–3) and activations (Korthikanti et al. 2022), most loaded GPU.

Under 1F1B pipeline device r holds the activations of min(p − r, m) microbatches of its layers
(the first: p microbatches of L/p layers, i.e. of all L layers), and the interleaved schedule
multiplies that by 1 + (p − 1)/(p·v) (Korthikanti §4.2.3). The first device also holds the input
embedding, the last the output layer; with uneven stages (``stages.split_layers``) those two hold
fewer layers and a middle device may be the most loaded, so every candidate device is counted and
the largest taken. The training state per GPU is ``zero_bytes``' bytes (the figures the trainer reports) of the
parameters the model inventory lists for the device (``costmodel.inventory``: the local pricer's count too).
"""

from __future__ import annotations

from collections.abc import Iterable

from modelpar.costmodel.assumptions import Assumptions
from modelpar.costmodel.inventory import Holding, embedding_elements, layer_elements, rank_elements, total_elements
from modelpar.costmodel.moe import moe_activation_bytes
from modelpar.costmodel.specs import ModelSpec, ParallelConfig
from modelpar.costmodel.stages import busiest_candidates, rank_loads
from modelpar.costmodel.zero_bytes import training_state_bytes

__all__ = [
    "activation_bytes_per_layer",
    "device_elements",
    "device_params",
    "end_working_bytes",
    "in_flight",
    "layerwise_stage_gb",
    "mean_device_params",
    "memory_breakdown",
    "moe_activation_delta",
    "stages_needed",
]

# Bytes per logit the last stage holds while a microbatch's loss is alive: the fp32 logits (the softmax) kept for the
# backward and the fp32 gradient written beside them (torch's log_softmax backward is out of place; Megatron's fused
# cross entropy, megatron/core/tensor_parallel/cross_entropy.py, works in place and needs less)
LOGIT_BYTES = 8.0
REPLICATED_COEFF = 10.0  # Korthikanti §4.1: LayerNorm inputs 4, QKV and MLP inputs 2 + 2, two dropout masks 1 + 1 (× s·b·h bytes)


def activation_bytes_per_layer(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    sharded_coeff: float = 24.0,
    flash_attention: bool = False,
    replicated_coeff: float = REPLICATED_COEFF,
) -> float:
    """Bytes of 16-bit activations one transformer layer keeps for backward, per GPU (Korthikanti 2022, Table 2).

    no parallelism: s·b·h·(34 + 5·a·s/h); tensor parallel: s·b·h·(10 + 24/t + 5·a·s/(h·t));
    + sequence parallel: s·b·h/t·(34 + 5·a·s/h); selective recomputation drops the 5·a·s/h
    (attention scores) term; full recomputation keeps only the layer input, 2·s·b·h (÷ t with
    sequence parallelism). ``sharded_coeff`` is the 24 for other MLP widths / GQA and
    ``replicated_coeff`` the 10 without dropout masks (``ModelSpec.act_sharded_coeff`` and
    ``act_replicated_coeff``); fused (flash) attention never stores the s² scores (its per-row
    softmax statistics, 4·a·s·b bytes, ≤ 0.03·s·b·h for a/h ≤ 1/128, are left out).
    """
    sbh = float(s) * b * h
    if recompute == "full":
        return 2.0 * sbh / (t if sequence_parallel else 1)
    scores = 0.0 if (flash_attention or recompute == "selective") else 5.0 * a * s / h
    if sequence_parallel:
        return sbh * (replicated_coeff + sharded_coeff + scores) / t
    return sbh * (replicated_coeff + (sharded_coeff + scores) / t)


def in_flight(p: int, v: int, m: int, rank: int) -> float:
    """Microbatches whose activations pipeline device ``rank`` holds at its peak, in units of its whole layer share.

    1F1B: min(p − rank, m). Interleaved (Megatron): 2(p − rank − 1) + (v − 1)·p warm-up chunk passes
    plus one, each 1/v of the device's layers; for rank 0 that is p·(1 + (p − 1)/(p·v)) (Korthikanti §4.2.3).
    """
    if v == 1:
        return float(min(p - rank, m))
    return min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v) / v  # m = p: all warm-up, m·v chunk passes


def device_elements(model: ModelSpec, cfg: ParallelConfig, ranks: Iterable[int], uniform: bool = False
                    ) -> dict[int, tuple[float, float]]:
    """(``device_params``, of which the routed expert weights under ep > 1, reduced over the d·cp/ep replicas
    holding them; 0 under the reference's ``uniform`` count) of each pipeline device of ``ranks``, from one
    look-up of the inventory each."""
    if uniform:
        return dict.fromkeys(ranks, (model.params / (cfg.t * cfg.p), 0.0))
    held, out = Holding.of(model, cfg), {}
    for r in ranks:
        params, experts = rank_elements(held, r)
        out[r] = (float(params), float(experts))
    return out


def device_params(model: ModelSpec, cfg: ParallelConfig, rank: int, uniform: bool = False) -> float:
    """Parameters a GPU of pipeline device ``rank`` holds: the model inventory's count of its stages
    (``inventory.rank_elements``: the layers, ÷ t where tensor parallelism splits them, the norms and row biases
    whole, the first device's embedding and learned positions (whole: Megatron replicates them over t), the
    last's final norm and output layer — with tied embeddings and p > 1 a copy of the word embedding whose
    gradient it all-reduces with the first — the routed experts E/ep). ``uniform`` spreads all P parameters
    evenly, P/(t·p), as the reference text's §6.2 does.
    """
    return device_elements(model, cfg, (rank,), uniform)[rank][0]


def mean_device_params(model: ModelSpec, cfg: ParallelConfig, uniform: bool = False) -> float:
    """``device_params`` averaged over the p pipeline devices: the inventory's total of a model replica ÷ p (the
    reference's P/(t·p) under ``uniform``)."""
    if uniform:
        return model.params / (cfg.t * cfg.p)
    return total_elements(Holding.of(model, cfg)) / cfg.p


def moe_activation_delta(model: ModelSpec, cfg: ParallelConfig) -> float:
    """16-bit bytes a layer (averaged) keeps beyond the dense accounting for its experts:
    ``costmodel.moe.moe_activation_bytes`` in place of the SwiGLU's 6·ffn/t per token (0 for full recomputation)."""
    if model.moe is None or cfg.recompute == "full":
        return 0.0
    tokens = cfg.micro_batch * model.seq // cfg.cp
    moe = moe_activation_bytes(model.moe, tokens, cfg.micro_batch, model.hidden, cfg.t, 2)
    return model.moe_share * (moe - tokens * 6 * model.ffn_size / cfg.t)


def end_working_bytes(model: ModelSpec, cfg: ParallelConfig, rank: int, a: Assumptions) -> float:
    """Transient bytes of the pipeline's ends on device ``rank``: on the last, one microbatch's logits
    (tokens × V/t × ``LOGIT_BYTES``: the last stage runs each microbatch's backward right after its forward);
    on the first, the dense [V/t, h] gradient the embedding's backward writes before it is added into the
    gradient buffer (16-bit). None under the reference's uniform stages."""
    if a.uniform_stages:
        return 0.0
    extra = 0.0
    if rank == cfg.p - 1:
        extra += cfg.micro_batch * model.seq / cfg.cp * model.vocab / cfg.t * LOGIT_BYTES
    if rank == 0:
        extra += embedding_elements(model, cfg.t) * a.param_bytes
    return extra


def memory_breakdown(model: ModelSpec, cfg: ParallelConfig, microbatches: int, a: Assumptions) -> dict[str, float]:
    """Bytes per GPU on the most loaded pipeline device: training ``state``, ``activations``, ``working`` and ``reserve``.

    ``working`` is one layer's activations while it is recomputed (full recomputation) and, under
    ZeRO-3, the gathered 16-bit weights and gradients of two layers (the one running and the one
    prefetched), and on the first and last device their ends' (``end_working_bytes``). Every device is a
    candidate: the first holds the embedding and the most microbatches, the last the output layer and its
    logits, a middle one may hold more layers.
    """
    s, b, h, t, sp = model.seq, cfg.micro_batch, model.hidden, cfg.t, cfg.sequence_parallel
    coeffs = (model.act_sharded_coeff, a.flash_attention, model.act_replicated_coeff)
    # context parallelism: s/cp tokens per rank, each attending to all s (the s² term's share too): ÷ cp
    per_layer = activation_bytes_per_layer(s, b, h, model.heads, t, sp, cfg.recompute, *coeffs) / cfg.cp
    per_layer += moe_activation_delta(model, cfg)
    working = (activation_bytes_per_layer(s, b, h, model.heads, t, sp, "none", *coeffs) / cfg.cp
               if cfg.recompute == "full" else 0.0)
    if cfg.zero == 3:  # a layer's parameters, averaged over the layers (the inventory's)
        working += 2 * layer_elements(Holding.of(model, cfg)) * (a.param_bytes + a.grad_bytes)
    p, v = cfg.p, cfg.v
    loads = rank_loads(model.layers, cfg)
    best: dict[str, float] = {}
    ranks = busiest_candidates(loads)
    # the inventory's parameters, of which the experts (ep > 1) sharded over the d·cp/ep replicas holding them
    held = device_elements(model, cfg, ranks, a.uniform_stages)
    for rank in ranks:
        layers = model.layers / p if a.uniform_stages else loads[rank]
        params, experts = held[rank]
        mem = {
            "state": training_state_bytes(params - experts, cfg.grad_ranks, cfg.zero, a.param_bytes, a.grad_bytes)
            + training_state_bytes(experts, cfg.grad_ranks // cfg.ep, cfg.zero, a.param_bytes, a.grad_bytes),
            "activations": per_layer * layers * in_flight(p, v, microbatches, rank),
            "working": working + end_working_bytes(model, cfg, rank, a),
            "reserve": a.memory_reserve_gb * 1e9,
        }
        if not best or sum(mem.values()) > sum(best.values()):
            best = mem
    return best


def layerwise_stage_gb(model: ModelSpec, stages: int, bytes_per_param: float) -> float:
    """§1.1: GB on the first stage of a layer-wise split: L/K layers plus the embedding, no activations."""
    return (model.layers / stages * model.layer_params + model.embedding_params) * bytes_per_param / 1e9


def stages_needed(model: ModelSpec, memory_gb: float, bytes_per_param: float, gpus_per_node: int = 8) -> int:
    """§1.1: fewest layer-wise stages K whose first stage fits ``memory_gb`` (GPT-3: 8 for inference, 48 for training).

    Assumptions: K fills whole nodes (a multiple of ``gpus_per_node``, or a divisor of it), K divides
    L so every stage holds the same layers, and the first stage also holds the embedding (≈ 0.35
    layer for GPT-3); activations are not counted. Bytes per parameter: 2 for 16-bit inference
    weights, 16 for mixed-precision Adam training.
    """
    for k in range(1, model.layers + 1):
        whole = k % gpus_per_node == 0 or gpus_per_node % k == 0
        if whole and model.layers % k == 0 and layerwise_stage_gb(model, k, bytes_per_param) <= memory_gb:
            return k
    raise ValueError(f"memory_gb ({memory_gb}) is too small for even one layer per stage of {model.name}")
