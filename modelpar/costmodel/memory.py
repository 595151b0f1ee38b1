"""Memory per GPU: training state and activations (Korthikanti et al. 2022), for the most loaded GPU.

The first pipeline stage is the most loaded: under 1F1B it holds the activations of p microbatches
(min(p, m)) of its L/p layers, i.e. of all L layers, and the interleaved schedule multiplies that
by 1 + (p − 1)/(p·v) (Korthikanti §4.2.3). It also holds the input embedding. When the stages are
uneven the first (and last) device hold fewer layers (``stage_loads``), so the second device, with
one (1F1B) or 2/v (interleaved) microbatch fewer in flight but a full share of layers, may be the
most loaded; both are counted and the larger taken.
"""

from __future__ import annotations

from modelpar.costmodel.assumptions import Assumptions
from modelpar.costmodel.specs import ModelSpec, ParallelConfig

__all__ = [
    "activation_bytes_per_layer",
    "in_flight",
    "layerwise_stage_gb",
    "memory_breakdown",
    "params_on_gpu",
    "stage_layers",
    "stage_loads",
    "stages_needed",
    "state_bytes_per_param",
]

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


def stage_layers(layers: int, p: int, v: int = 1) -> int:
    """Layers on the busiest device: v chunks of ⌈L/(p·v)⌉ (= L/p when p·v divides L)."""
    return -(-layers // (p * v)) * v


def stage_loads(layers: int, p: int, v: int = 1) -> tuple[int, int, int]:
    """Layers on the (first, busiest middle, last) pipeline device.

    Even split: L/p each. Otherwise every device gets v chunks of c = ⌈L/(p·v)⌉ and the p·v·c − L
    missing layers are taken from the first device (half, rounded up) and the last (the rest), each
    keeping at least one layer, before any middle device: those two also hold the embedding and the
    output layer. Llama 3 (Dubey et al. 2024 §3.3.2: 126 layers, p = 16, one layer fewer on the first
    and last stages), BLOOM (DeepSpeed counting the two embeddings as layers: 70 + 2 = 12·6) and
    Megatron's ``--decoder-first/last-pipeline-num-layers`` place them so.
    """
    if p == 1:
        return layers, layers, layers
    full = stage_layers(layers, p, v)
    missing = p * full - layers
    first = min((missing + 1) // 2, full - 1)
    last = min(missing - first, full - 1)
    rest = missing - first - last  # spread over the p − 2 middle devices
    middle = full - (rest // (p - 2) if p > 2 else 0)
    return full - first, middle, full - last


def in_flight(p: int, v: int, m: int, rank: int) -> float:
    """Microbatches whose activations pipeline device ``rank`` holds at its peak, in units of its whole layer share.

    1F1B: min(p − rank, m). Interleaved (Megatron): 2(p − rank − 1) + (v − 1)·p warm-up chunk passes
    plus one, each 1/v of the device's layers; for rank 0 that is p·(1 + (p − 1)/(p·v)) (Korthikanti §4.2.3).
    """
    if v == 1:
        return float(min(p - rank, m))
    return min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v) / v  # m = p: all warm-up, m·v chunk passes


def params_on_gpu(model: ModelSpec, cfg: ParallelConfig, uniform: bool, rank: int = 0) -> float:
    """Parameters held by a GPU of pipeline device ``rank`` (0 or a middle one), split t ways.

    Rank 0 holds its layers (``stage_loads``) and the embedding; the output layer sits on the last
    stage (with p = 1 on the same GPU). ``uniform`` spreads all P parameters evenly, P/(t·p), as the
    reference text's §6.2 does.
    """
    if uniform:
        return model.params / (cfg.t * cfg.p)
    first, middle, _ = stage_loads(model.layers, cfg.p, cfg.v)
    if rank > 0:
        return middle * model.layer_params / cfg.t
    emb = model.embedding_params
    if cfg.p > 1 and not model.tied_embeddings:  # an untied output layer lives on the last stage
        emb -= model.vocab * model.hidden
    return (first * model.layer_params + emb) / cfg.t


def state_bytes_per_param(cfg: ParallelConfig, a: Assumptions) -> float:
    """Training-state bytes per parameter: ``state_bytes``, of which ``sharded_state_bytes`` split over d when sharded.

    Megatron's distributed optimizer (ZeRO-1) with BF16 weights and an FP32 gradient buffer: 18 → 6 + 12/d;
    sharding the FP32 gradients too (ZeRO-2, Llama 3's FSDP without re-sharding weights): 18 → 2 + 16/d.
    """
    if not a.distributed_optimizer:
        return a.state_bytes
    return a.state_bytes - a.sharded_state_bytes * (1 - 1 / cfg.d)


def memory_breakdown(model: ModelSpec, cfg: ParallelConfig, microbatches: int, a: Assumptions) -> dict[str, float]:
    """Bytes per GPU on the most loaded device: training ``state``, ``activations``, ``working`` (one layer
    recomputed) and ``reserve``. That is the first device, or with uneven stages possibly the second."""
    kw = dict(
        s=model.seq, b=cfg.micro_batch, h=model.hidden, a=model.heads, t=cfg.t,
        sequence_parallel=cfg.sequence_parallel, sharded_coeff=model.act_sharded_coeff,
        flash_attention=a.flash_attention, replicated_coeff=model.act_replicated_coeff,
    )
    per_layer = activation_bytes_per_layer(recompute=cfg.recompute, **kw)
    working = activation_bytes_per_layer(recompute="none", **kw) if cfg.recompute == "full" else 0.0
    state = state_bytes_per_param(cfg, a)
    p, v = cfg.p, cfg.v
    first, middle, _ = stage_loads(model.layers, p, v)
    ranks = (0, 1) if first < middle and not a.uniform_stages else (0,)
    best: dict[str, float] = {}
    for rank in ranks:
        layers = first if rank == 0 else middle
        mem = {
            "state": params_on_gpu(model, cfg, a.uniform_stages, rank) * state,
            "activations": per_layer * layers * in_flight(p, v, microbatches, rank),
            "working": working,
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
