"""Memory per GPU: training state and activations (Korthikanti et al. 2022), for the most loaded GPU.

The first pipeline stage is the most loaded: under 1F1B it holds the activations of p microbatches
(min(p, m)) of its L/p layers, i.e. of all L layers, and the interleaved schedule multiplies that
by 1 + (p − 1)/(p·v) (Korthikanti §4.2.3). It also holds the input embedding.
"""

from __future__ import annotations

from modelpar.costmodel.assumptions import Assumptions
from modelpar.costmodel.specs import ModelSpec, ParallelConfig

__all__ = ["activation_bytes_per_layer", "layerwise_stage_gb", "memory_breakdown", "params_on_gpu", "stage_layers",
           "stages_needed"]

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
) -> float:
    """Bytes of 16-bit activations one transformer layer keeps for backward, per GPU (Korthikanti 2022, Table 2).

    no parallelism: s·b·h·(34 + 5·a·s/h); tensor parallel: s·b·h·(10 + 24/t + 5·a·s/(h·t));
    + sequence parallel: s·b·h/t·(34 + 5·a·s/h); selective recomputation drops the 5·a·s/h
    (attention scores) term; full recomputation keeps only the layer input, 2·s·b·h (÷ t with
    sequence parallelism). ``sharded_coeff`` is the 24 for other MLP widths / GQA; fused
    (flash) attention never stores the s² scores.
    """
    sbh = float(s) * b * h
    if recompute == "full":
        return 2.0 * sbh / (t if sequence_parallel else 1)
    scores = 0.0 if (flash_attention or recompute == "selective") else 5.0 * a * s / h
    if sequence_parallel:
        return sbh * (REPLICATED_COEFF + sharded_coeff + scores) / t
    return sbh * (REPLICATED_COEFF + (sharded_coeff + scores) / t)


def stage_layers(layers: int, p: int, v: int = 1) -> int:
    """Layers on the busiest device: v chunks of ⌈L/(p·v)⌉ (= L/p when p·v divides L)."""
    return -(-layers // (p * v)) * v


def params_on_gpu(model: ModelSpec, cfg: ParallelConfig, uniform: bool) -> float:
    """Parameters held by a GPU of the first stage: its L/p layers and the embedding, split t ways.

    ``uniform`` spreads all P parameters evenly, P/(t·p), as the reference text's §6.2 does.
    The output layer sits on the last stage; with p = 1 it is on the same GPU.
    """
    if uniform:
        return model.params / (cfg.t * cfg.p)
    first = model.embedding_params
    if cfg.p > 1 and not model.tied_embeddings:  # an untied output layer lives on the last stage
        first -= model.vocab * model.hidden
    return (stage_layers(model.layers, cfg.p, cfg.v) * model.layer_params + first) / cfg.t


def memory_breakdown(model: ModelSpec, cfg: ParallelConfig, microbatches: int, a: Assumptions) -> dict[str, float]:
    """Bytes per GPU on the first stage: training ``state``, ``activations``, ``working`` (one layer recomputed) and ``reserve``."""
    state_per_param = a.state_bytes
    if a.distributed_optimizer:
        state_per_param += a.sharded_state_bytes * (1 / cfg.d - 1)
    kw = dict(
        s=model.seq, b=cfg.micro_batch, h=model.hidden, a=model.heads, t=cfg.t,
        sequence_parallel=cfg.sequence_parallel, sharded_coeff=model.act_sharded_coeff,
        flash_attention=a.flash_attention,
    )
    per_layer = activation_bytes_per_layer(recompute=cfg.recompute, **kw)
    in_flight = min(cfg.p, microbatches)
    interleave = 1 + (cfg.p - 1) / (cfg.p * cfg.v) if cfg.v > 1 else 1.0
    layers = stage_layers(model.layers, cfg.p, cfg.v)
    working = activation_bytes_per_layer(recompute="none", **kw) if cfg.recompute == "full" else 0.0
    return {
        "state": params_on_gpu(model, cfg, a.uniform_stages) * state_per_param,
        "activations": per_layer * layers * in_flight * interleave,
        "working": working,
        "reserve": a.memory_reserve_gb * 1e9,
    }


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
