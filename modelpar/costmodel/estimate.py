"""Step time, memory and throughput of one 3D-parallel configuration.

Per microbatch, each pipeline device runs its layers (matmuls at the efficiency curve, plus
memory-bound element-wise work and per-kernel latency) and their tensor-parallel collectives
(NVLink when t fits in a node, else the network), the first device also the embedding and the
last the output layer and cross entropy (``ends.py``), and every device its point-to-point
transfers. The pipelined step is m·T_busiest + (p − 1)/v·T_average (Megatron SC'21 §2.2, the
busiest device setting the pace) plus the transfers of the fill and the drain; ZeRO-2/3's
collectives beside each microbatch (``network.sharded_dp_exposed``); then the exposed data-parallel
reduction (``zero_bytes``' traffic on ``network.ring_time``'s rings) and the optimizer step.
Ranks are ordered tensor, data, pipeline (Megatron's default), which decides which link each
collective crosses. docs/costmodel.md derives each term and gives its source.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelpar.costmodel.assumptions import DEFAULT, Assumptions
from modelpar.costmodel.axes import expert_splits, heads_split, sequence_parallel_choices
from modelpar.costmodel.context import cp_layer_time
from modelpar.costmodel.ends import embedding_sync, embedding_time, hbm_seconds, output_layer_time
from modelpar.costmodel.measured import collective_time, gemm_efficiency, layer_gemms
from modelpar.costmodel.memory import activation_bytes_per_layer, device_elements, mean_device_params, memory_breakdown
from modelpar.costmodel.moe import all_to_alls
from modelpar.costmodel.network import ring_time, sharded_dp_exposed
from modelpar.costmodel.specs import ClusterSpec, ModelSpec, ParallelConfig, context_split_reason
from modelpar.costmodel.stages import busiest_candidates, check_split, rank_loads
from modelpar.costmodel.zero_bytes import (
    dp_bytes_at_step_end,
    optimizer_state_bytes_per_param,
    shard_elements,
)
from modelpar.formulas import allgather_bytes, allreduce_bytes, bubble_over_ideal_compute

__all__ = [
    "PARTS",
    "Estimate",
    "check_config",
    "ep_layer_time",
    "estimate",
    "estimate_checked",
    "layer_time",
    "matmul_efficiency",
    "microbatch_times",
    "optimizer_time",
    "output_layer_time",  # ends.py's, re-exported (schedule_choice prices the last stage with it)
    "tp_collectives",
    "tp_overlapped",
    "transfer_time",
]

PARTS = ("compute", "bubble", "tp", "cp", "ep", "pp", "dp", "optimizer")  # where the step time goes; they add up to it


@dataclass(frozen=True)
class Estimate:
    """The model's prediction for one configuration; times in seconds, memory in bytes per GPU."""

    config: ParallelConfig
    batch: int
    microbatches: int  # m = B/(d·b), per pipeline
    step_time_s: float
    time: dict[str, float]  # PARTS: they add up to step_time_s; "bubble" includes the stage imbalance
    memory: dict[str, float]  # state, activations, working, reserve (most loaded device)
    memory_limit: float  # bytes available on the GPU
    tflops_per_gpu: float  # executed FLOPs (recomputation included) per second per GPU, / 1e12
    mfu: float  # model FLOPs (3 × forward, no recomputation) / (peak × time)
    bubble_over_ideal_compute: float  # (p − 1)/(v·m), Megatron's closed form
    efficiency: float  # matmul efficiency used
    links: dict[str, str]  # which link the tp, pp and dp traffic crosses
    rank_layers: tuple[int, ...]  # transformer layers on each pipeline rank


    @property
    def memory_gb(self) -> float:
        return sum(self.memory.values()) / 1e9

    @property
    def fits(self) -> bool:
        return sum(self.memory.values()) <= self.memory_limit

    def as_dict(self) -> dict[str, object]:
        """The flat record ``modelpar plan --json`` prints."""
        c = self.config
        return {
            "t": c.t, "cp": c.cp, "cp_comm": c.cp_comm, "p": c.p, "d": c.d, "ep": c.ep, "micro_batch": c.micro_batch, "v": c.v,
            "recompute": c.recompute, "sequence_parallel": c.sequence_parallel, "zero": c.zero,
            "rank_layers": list(self.rank_layers), "device_layers": list(self.rank_layers),  # the old key too
            "microbatches": self.microbatches, "step_time_s": self.step_time_s,
            "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu, "memory_gb": self.memory_gb,
            "bubble_over_ideal_compute": self.bubble_over_ideal_compute,
            "time_s": dict(self.time), "memory_breakdown_gb": {k: v / 1e9 for k, v in self.memory.items()},
            "links": dict(self.links),
        }


def check_config(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, batch: int,
                 a: Assumptions = DEFAULT) -> str | None:
    """Why ``cfg`` cannot run ``model`` on ``cluster`` with global batch ``batch``, or None if it can (memory aside)."""
    if cfg.gpus != cluster.gpus:
        if cfg.cp > 1:
            return f"t·cp·p·d = {cfg.t}·{cfg.cp}·{cfg.p}·{cfg.d} = {cfg.gpus} is not the {cluster.gpus} GPUs"
        return f"t·p·d = {cfg.t}·{cfg.p}·{cfg.d} = {cfg.gpus} is not the {cluster.gpus} GPUs"
    reason = context_split_reason(model.seq, cfg.cp) or heads_split(model, cfg.t)
    if reason:
        return reason
    split = check_split(model.layers, cfg.p, cfg.v, cfg.stage_layers)
    if split:
        return split
    if a.uniform_stages and model.layers % (cfg.p * cfg.v):
        return f"layers ({model.layers}) not divisible by p·v = {cfg.p * cfg.v} (the reference's equal stages)"
    if batch % (cfg.d * cfg.micro_batch):
        return f"batch ({batch}) not divisible by d·micro_batch = {cfg.d * cfg.micro_batch}"
    if cfg.v > 1 and not a.interleaving:
        return f"the {a.engine} engine has no interleaved schedule (v = {cfg.v})"
    if cfg.v > 1 and (cfg.p == 1 or (batch // (cfg.d * cfg.micro_batch)) % cfg.p):
        return f"interleaving (v = {cfg.v}) needs p > 1 and microbatches divisible by p = {cfg.p}"
    if cfg.sequence_parallel not in sequence_parallel_choices(cfg.t):
        return "sequence parallelism needs t > 1"
    if cfg.ep > 1 and cfg.ep not in expert_splits(model.moe, cfg.d):
        return (f"ep = {cfg.ep} needs a mixture of experts whose experts and d = {cfg.d} it divides"
                + (f" (experts {model.moe.experts})" if model.moe is not None else " (the model is dense)"))
    return None


def matmul_efficiency(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, a: Assumptions) -> float:
    """Fraction of peak the layer GEMMs reach: ceiling × x/(x + x½) for tokens b·s and per-GPU width h/t,
    or, on a measured profile, the profile's throughput at this layer's GEMM shapes (``gemm_efficiency``)."""
    if a.matmul_efficiency is not None:
        return a.matmul_efficiency
    if cluster.measured is not None:
        return gemm_efficiency(model, cluster, cfg)
    tokens = cfg.micro_batch * model.seq / cfg.cp
    width = model.hidden / cfg.t
    return (cluster.gpu.matmul_efficiency * tokens / (tokens + a.gemm_tokens_half)
            * width / (width + a.gemm_width_half))


def layer_time(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, a: Assumptions, eff: float
               ) -> tuple[float, float]:
    """(compute, exposed tensor-parallel communication) of one transformer layer, one microbatch, one GPU.

    Passes: forward, backward (2 × forward) and, with full recomputation, the forward again. Selective
    recomputation re-runs QKᵀ, softmax, its dropout and attention·V (Korthikanti §5): their FLOPs and
    the element-wise passes over the s² scores. Collectives, in all-reduces of b·s·h: ``tp_collectives``.
    Context parallelism: the rank's s/cp tokens, each attending to all s (``modelpar.costmodel.context``).
    """
    s, h, b, t = model.seq, model.hidden, cfg.micro_batch, cfg.t
    tokens = b * s / cfg.cp
    full = cfg.recompute == "full"
    passes = 3 + full
    routed = model.expert_flops_per_token  # router and routed experts: whole on every tensor-parallel rank
    flops = tokens * ((model.layer_flops_per_token - routed) / t + routed) * passes
    stream = activation_bytes_per_layer(s, b, h, model.heads, t, cfg.sequence_parallel, "none",
                                        model.act_sharded_coeff, a.flash_attention, model.act_replicated_coeff) / cfg.cp
    hbm = a.elementwise_passes * stream * passes
    if cfg.recompute == "selective":
        flops += tokens * 4 * s * h / t
        if not a.flash_attention:
            hbm += a.elementwise_passes * 5.0 * model.heads * s * tokens / t  # scores, mask, dropout output
    compute = flops / (cluster.gpu.peak_tflops * 1e12 * eff) + hbm_seconds(hbm, cluster) + a.layer_latency_s * passes
    if t == 1:
        return compute, 0.0
    if a.tp_comm_overlap and cfg.sequence_parallel and model.moe is None:
        return compute, tp_overlapped(model, cluster, cfg, a, eff)
    one = collective_time(allreduce_bytes(tokens * h * a.param_bytes, t), cluster.link_gbps(t), a, cluster, "all_reduce", t)
    return compute, tp_collectives(cfg, a) * one


def tp_overlapped(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, a: Assumptions, eff: float) -> float:
    """Exposed sequence-parallel collectives of one layer and microbatch when each is split into t chunks and
    pipelined with the GEMM that consumes or produces it (``tp_comm_overlap``: Megatron-Core's --tp-comm-overlap
    with TransformerEngine's userbuffers; PyTorch's asynchronous TP; Wang et al. 2023, "Overlap communication
    with dependent computation via decomposition", ASPLOS'23): per pair, max(0, collective − GEMM) plus the one
    chunk that cannot overlap, collective/t.

    Pairs (``measured.layer_gemms``' QKV, output projection, MLP up and down): forward, the all-gather into
    QKV and up, the reduce-scatter out of the projection and down (again in a full recomputation); backward,
    the mirrored collective of each with that GEMM's input-gradient GEMM, and (``sp_regather``) the re-gather
    of QKV's and up's input with their weight-gradient GEMMs.
    """
    t = cfg.t
    tokens = cfg.micro_batch * model.seq // cfg.cp
    half = collective_time(allgather_bytes(tokens * model.hidden * a.param_bytes, t), cluster.link_gbps(t), a, cluster,
                           "all_gather", t)
    rate = cluster.gpu.peak_tflops * 1e12 * eff
    gemms = [2.0 * m * n * k / rate for m, n, k in layer_gemms(model, tokens, t)]
    exposed = [max(0.0, half - g) + half / t for g in gemms]
    forward = sum(exposed) * (2 if cfg.recompute == "full" else 1)
    regather = exposed[0] + exposed[2] if a.sp_regather else 0.0
    return forward + sum(exposed) + regather


def ep_layer_time(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, a: Assumptions) -> float:
    """Expert-parallel all-to-alls of one layer (averaged over the layers) and microbatch, exposed: dispatch and
    combine forward (again in a full recomputation) and their gradients backward (``costmodel.moe.all_to_alls``),
    over the ep ranks t apart (ranks ordered t, d, p: the link of a span of t·ep)."""
    if cfg.ep == 1 or model.moe is None:
        return 0.0
    tokens = cfg.micro_batch * model.seq // cfg.cp
    span = cfg.t * cfg.ep
    total = 0.0
    for phase, sent in all_to_alls(model.moe, tokens, model.hidden, cfg.ep, a.param_bytes):
        one = collective_time(sent, cluster.link_gbps(span), a, cluster, "all_to_all", cfg.ep, span)
        total += one * (2 if phase == "forward" and cfg.recompute == "full" else 1)
    return model.moe_share * total


def tp_collectives(cfg: ParallelConfig, a: Assumptions) -> float:
    """Exposed tensor-parallel collectives of one layer and microbatch, in all-reduces of b·s·h (Megatron).

    Forward: the all-reduce after the attention block and after the MLP (g, §5.4), again in a full
    recomputation. Backward: the all-reduce of the input gradient of each block's first linear layer
    (f), which ``tp_overlap`` hides under the weight-gradient GEMM (Megatron-LM's asynchronous
    all-reduce). Sequence parallelism turns each all-reduce into a reduce-scatter + all-gather of the
    same volume (Korthikanti §4.2.2) and re-gathers the saved input of each first linear for its weight
    gradient in the backward; the all-gather of each block's output gradient cannot hide (the next GEMM
    needs it), the re-gather and the input-gradient reduce-scatter can. An engine that saves the gathered
    input instead (``sp_regather`` False: PyTorch DTensor) has no re-gather: 4 in all, not 5, when none hides.
    """
    forward = 2.0 * (2 if cfg.recompute == "full" else 1)
    if cfg.sequence_parallel:
        return forward + 1.0 + (2.0 if a.sp_regather else 1.0) * (1 - a.tp_overlap)
    return forward + 2.0 * (1 - a.tp_overlap)


def transfer_time(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, a: Assumptions) -> float:
    """One activation (or its gradient) across a pipeline boundary, b·s·h 16-bit values.

    Neighbouring stages are t·d ranks apart: the network unless the whole job is in one node. With
    sequence parallelism each rank holds 1/t; without it Megatron's scatter/gather sends 1/t per
    rank over the network and all-gathers it on NVLink (SC'21 §4.1); otherwise all of it.
    """
    if cfg.p == 1:
        return 0.0
    act = cfg.micro_batch * model.seq / cfg.cp * model.hidden * float(a.param_bytes)
    span = cluster.gpus
    if cfg.sequence_parallel:
        return collective_time(act / cfg.t, cluster.link_gbps(span), a, cluster, "p2p", 2, span)
    if a.pp_scatter_gather and cfg.t > 1 and cluster.link_name(span) == "network":
        return (collective_time(act / cfg.t, cluster.link_gbps(span), a, cluster, "p2p", 2, span)
                + collective_time(allgather_bytes(act, cfg.t), cluster.intra_node_gbps, a, cluster, "all_gather", cfg.t))
    return collective_time(act, cluster.link_gbps(span), a, cluster, "p2p", 2, span)


def optimizer_time(params: float, cfg: ParallelConfig, cluster: ClusterSpec, a: Assumptions) -> float:
    """The optimizer step of a rank holding ``params``: memory-bound passes over its shard (Megatron's order).

    The gradient norm reads the gradients; AdamW reads the gradient and reads and writes the master
    weights and both moments; the master weights are copied into the 16-bit ones; the gradient
    buffer is zeroed (all of it unless ZeRO-2/3 shard it).
    """
    if not a.optimizer_step:
        return 0.0
    shard = shard_elements(params, cfg.grad_ranks, cfg.zero >= 1)
    grads = shard_elements(params, cfg.grad_ranks, cfg.zero >= 2)
    g, w = a.grad_bytes, a.param_bytes
    adamw = g + 2 * optimizer_state_bytes_per_param(w)
    copy = (4 + w) if w < 4 else 0  # 16-bit weights from the fp32 master copy
    return hbm_seconds(shard * (g + adamw + copy) + grads * g, cluster)


def estimate(
    model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, batch: int, assumptions: Assumptions = DEFAULT
) -> Estimate:
    """Predict one training step of ``model`` with global batch ``batch`` (sequences) under ``cfg``."""
    reason = check_config(model, cluster, cfg, batch, assumptions)
    if reason:
        raise ValueError(f"config {cfg}: {reason}")
    return estimate_checked(model, cluster, cfg, batch, assumptions)


def _accumulation(params: float, cluster: ClusterSpec, a: Assumptions) -> float:
    """A microbatch's separate gradient accumulation pass: read the new 16-bit gradient, read and write the sum."""
    return hbm_seconds(params * (a.param_bytes + 2 * a.grad_bytes), cluster) if a.grad_accumulation_pass else 0.0


def microbatch_times(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, a: Assumptions, per_layer: float,
                     ends: tuple[float, float], loads: tuple[int, ...]
                     ) -> tuple[float, float, float, float, dict[int, float]]:
    """One microbatch on the pipeline's devices: (busiest device, average device, exposed sharded DP, its
    once-per-step part, parameters).

    A device runs its layers, the first also the embedding and the last the output layer (``ends``: their
    times), each its gradient accumulation pass; ZeRO-2/3 collectives run beside that
    (``sharded_dp_exposed``). Only the devices that can be the busiest are evaluated: the others differ from
    them in nothing but rank.
    """
    p = cfg.p
    first, last = ends
    ranks = busiest_candidates(loads)
    params = {r: n for r, (n, _) in device_elements(model, cfg, ranks, a.uniform_stages).items()}
    if a.uniform_stages or p == 1:
        work = dict.fromkeys(ranks, model.layers / p * per_layer + (first + last) / p)
    else:
        work = {r: loads[r] * per_layer + (first if r == 0 else 0.0) + (last if r == p - 1 else 0.0) for r in ranks}
    work = {r: w + _accumulation(params[r], cluster, a) for r, w in work.items()}
    sharded = {r: sharded_dp_exposed(loads[r], params[r], work[r], cfg, cluster, a) for r in ranks}
    total = {r: work[r] + sharded[r][0] for r in ranks}
    busiest = max(total.values())
    average = (model.layers / p * per_layer + (first + last) / p
               + _accumulation(mean_device_params(model, cfg, a.uniform_stages), cluster, a))
    return busiest, average, busiest - max(work.values()), max(tail for _, tail in sharded.values()), params


def estimate_checked(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, batch: int, a: Assumptions,
                     memory: dict[str, float] | None = None) -> Estimate:
    """``estimate`` for a configuration ``check_config`` has accepted; ``memory`` its ``memory_breakdown`` if known."""
    p, v, m = cfg.p, cfg.v, batch // (cfg.d * cfg.micro_batch)
    eff = matmul_efficiency(model, cluster, cfg, a)
    layer_compute, layer_tp = layer_time(model, cluster, cfg, a, eff)
    layer_cp = cp_layer_time(model, cluster, cfg, a, eff)
    layer_ep = ep_layer_time(model, cluster, cfg, a)
    ends = embedding_time(model, cluster, cfg, a), output_layer_time(model, cluster, cfg, a, eff)
    transfer = transfer_time(model, cluster, cfg, a)
    loads = rank_loads(model.layers, cfg)
    busiest, average, sharded_dp, sharded_tail, params = microbatch_times(model, cluster, cfg, a,
                                                            layer_compute + layer_tp + layer_cp + layer_ep, ends, loads)

    # --- the pipelined microbatches (SC'21 §2.2: the busiest device sets the pace), then the step's end ---
    p2p = 2 * v * transfer * (1 - a.pp_overlap) + v * a.pp_engine_overhead_s if p > 1 else 0.0
    fill = 2 * (p - 1) * transfer  # the first activation and the last gradient cross every boundary
    pipe = m * (busiest + p2p) + (p - 1) / v * average + fill
    heaviest = max(params.values())
    g = cfg.grad_ranks  # d·cp ranks, t apart
    end_bytes = dp_bytes_at_step_end(heaviest, g, cfg.zero, a.grad_bytes, a.param_bytes)
    dp_op = "all_reduce" if cfg.zero <= 1 else "all_gather"  # ZeRO-1: a reduce-scatter and an all-gather
    dp_end = ((1 - a.dp_overlap) * ring_time(end_bytes, dp_op, g, cfg.t, cluster, a) + sharded_tail
              + embedding_sync(model, cluster, cfg, a))
    optimizer = optimizer_time(heaviest, cfg, cluster, a)
    step = pipe + dp_end + optimizer

    layers = model.layers / p
    time = {
        "compute": m * (average - layers * (layer_tp + layer_cp + layer_ep)),
        "tp": m * layers * layer_tp,
        "cp": m * layers * layer_cp,
        "ep": m * layers * layer_ep,
        "pp": m * p2p + fill,
        "dp": dp_end + m * sharded_dp,
        "optimizer": optimizer,
    }
    time["bubble"] = step - sum(time.values())  # the fill and drain, and the busiest device's excess
    tokens = batch * model.seq  # per iteration, all GPUs
    passes = 3 + (cfg.recompute == "full")
    attention_again = 4 * model.seq * model.hidden if cfg.recompute == "selective" else 0
    executed = tokens * (model.layers * (model.layer_flops_per_token * passes + attention_again)
                         + 3 * model.logits_flops_per_token)
    n, peak = cluster.gpus, cluster.gpu.peak_tflops * 1e12
    return Estimate(
        config=cfg, batch=batch, microbatches=m, step_time_s=step, time={k: time[k] for k in PARTS},
        memory=memory if memory is not None else memory_breakdown(model, cfg, m, a),
        memory_limit=a.memory_limit(cluster.gpu.memory_gb),
        tflops_per_gpu=executed / (n * step) / 1e12,
        mfu=model.model_flops(tokens) / (n * step * peak),
        bubble_over_ideal_compute=bubble_over_ideal_compute(p, m, v), efficiency=eff,
        links={"tp": cluster.link_name(cfg.t) if cfg.t > 1 else "-",
               "pp": cluster.link_name(cluster.gpus) if p > 1 else "-",
               "dp": cluster.link_name(cfg.t * g) if g > 1 else "-",
               **({"ep": cluster.link_name(cfg.t * cfg.ep)} if cfg.ep > 1 else {}),
               **({"cp": cluster.link_name(cfg.t * cfg.cp)} if cfg.cp > 1 else {})},
        rank_layers=loads,
    )
