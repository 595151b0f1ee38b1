"""Step time, memory and throughput of one 3D-parallel configuration.

Per microbatch, each pipeline device runs its L/p layers (matmuls at the efficiency curve, plus
memory-bound element-wise work and per-kernel latency), the tensor-parallel all-reduces of those
layers (4 per layer, 6 with full recomputation, §6.2; NVLink when t fits in a node, else the
network) and its point-to-point transfers (2·v per microbatch). The 1F1B step is then
m·T_slowest + (p − 1)/v·T_average (Megatron SC'21 §2.2 with uneven stages) plus the transfers of the fill
and drain, plus the exposed
data-parallel gradient all-reduce (ring, 2(d − 1)/d). Ranks are ordered tensor, data, pipeline
(Megatron's default), which decides which link each collective crosses.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelpar.costmodel.assumptions import DEFAULT, Assumptions
from modelpar.costmodel.formulas import allgather_bytes, allreduce_bytes, bubble_fraction
from modelpar.costmodel.memory import activation_bytes_per_layer, memory_breakdown, params_on_gpu, stage_loads
from modelpar.costmodel.specs import ClusterSpec, ModelSpec, ParallelConfig

__all__ = ["Estimate", "check_config", "estimate", "matmul_efficiency"]


@dataclass(frozen=True)
class Estimate:
    """The model's prediction for one configuration; times in seconds, memory in bytes per GPU."""

    config: ParallelConfig
    batch: int
    microbatches: int  # m = B/(d·b), per pipeline
    step_time_s: float
    time: dict[str, float]  # compute, bubble, tp, pp, dp: they add up to step_time_s
    memory: dict[str, float]  # state, activations, working, reserve (first stage)
    memory_limit: float  # bytes available on the GPU
    tflops_per_gpu: float  # executed FLOPs (recomputation included) per second per GPU, / 1e12
    mfu: float  # model FLOPs (3 × forward, no recomputation) / (peak × time)
    bubble: float  # (p − 1)/(v·m), Megatron's closed form (relative to ideal compute)
    efficiency: float  # matmul efficiency used
    links: dict[str, str]  # which link the tp, pp and dp traffic crosses

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
            "t": c.t, "p": c.p, "d": c.d, "micro_batch": c.micro_batch, "v": c.v,
            "recompute": c.recompute, "sequence_parallel": c.sequence_parallel,
            "microbatches": self.microbatches, "step_time_s": self.step_time_s,
            "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu, "memory_gb": self.memory_gb,
            "bubble": self.bubble,
            "time_s": dict(self.time), "memory_breakdown_gb": {k: v / 1e9 for k, v in self.memory.items()},
            "links": dict(self.links),
        }


def check_config(
    model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, batch: int, uneven_layers: bool = False
) -> str | None:
    """Why ``cfg`` cannot run ``model`` on ``cluster`` with global batch ``batch``, or None if it can (memory aside)."""
    if cfg.gpus != cluster.gpus:
        return f"t·p·d = {cfg.t}·{cfg.p}·{cfg.d} = {cfg.gpus} is not the {cluster.gpus} GPUs"
    if model.heads % cfg.t or (model.kv_heads or model.heads) % cfg.t:
        return f"heads ({model.heads}, kv {model.kv_heads or model.heads}) not divisible by t = {cfg.t}"
    # uneven stages may leave the first and last chunk with only the embedding / output layer (Llama 3 §3.3.2)
    if cfg.p * cfg.v > model.layers + 2 * uneven_layers or (model.layers % (cfg.p * cfg.v) and not uneven_layers):
        return f"layers ({model.layers}) not divisible by p·v = {cfg.p * cfg.v}"
    if batch % (cfg.d * cfg.micro_batch):
        return f"batch ({batch}) not divisible by d·micro_batch = {cfg.d * cfg.micro_batch}"
    if cfg.v > 1 and (cfg.p == 1 or (batch // (cfg.d * cfg.micro_batch)) % cfg.p):
        return f"interleaving (v = {cfg.v}) needs p > 1 and microbatches divisible by p = {cfg.p}"
    if cfg.sequence_parallel and cfg.t == 1:
        return "sequence parallelism needs t > 1"
    return None


def matmul_efficiency(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, a: Assumptions) -> float:
    """Fraction of peak the layer GEMMs reach: ceiling × x/(x + x½) for tokens b·s and per-GPU width h/t."""
    if a.matmul_efficiency is not None:
        return a.matmul_efficiency
    tokens = cfg.micro_batch * model.seq
    width = model.hidden / cfg.t
    return (cluster.gpu.matmul_efficiency * tokens / (tokens + a.gemm_tokens_half)
            * width / (width + a.gemm_width_half))


def _collective(nbytes: float, gbps: float, a: Assumptions) -> float:
    return nbytes / (gbps * 1e9 * a.link_efficiency) + a.collective_latency_s


def estimate(
    model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, batch: int, assumptions: Assumptions = DEFAULT
) -> Estimate:
    """Predict one training step of ``model`` with global batch ``batch`` (sequences) under ``cfg``."""
    reason = check_config(model, cluster, cfg, batch, assumptions.uneven_layers)
    if reason:
        raise ValueError(f"config {cfg}: {reason}")
    a, gpu = assumptions, cluster.gpu
    t, p, d, b, v = cfg.t, cfg.p, cfg.d, cfg.micro_batch, cfg.v
    s, h = model.seq, model.hidden
    m = batch // (d * b)
    peak = gpu.peak_tflops * 1e12
    eff = matmul_efficiency(model, cluster, cfg, a)
    full = cfg.recompute == "full"
    fwd_passes = 2 if full else 1  # forward, and the forward again before backward
    tokens = b * s

    # --- one layer, one microbatch, one GPU ---------------------------------------------------
    layer_fwd = tokens * model.layer_flops_per_token / t
    layer_exec = layer_fwd * (2 + fwd_passes)
    if cfg.recompute == "selective":  # QKᵀ and attention·V again (Korthikanti §5)
        layer_exec += tokens * 4 * s * h / t
    stream = activation_bytes_per_layer(
        s, b, h, model.heads, t, cfg.sequence_parallel, "none", model.act_sharded_coeff, a.flash_attention,
        model.act_replicated_coeff,
    )
    layer_compute = (layer_exec / (peak * eff)
                     + a.elementwise_passes * stream * (2 + fwd_passes) / (gpu.hbm_tb_s * 1e12)
                     + a.layer_latency_s * (2 + fwd_passes))
    tp_link = cluster.link_gbps(t)
    layer_tp = 0.0 if t == 1 else (4 + 2 * full) * _collective(allreduce_bytes(tokens * h * 2, t), tp_link, a)

    # --- output layer (vocabulary-parallel, fused cross entropy) ---------------------------------
    logits_exec = 3 * tokens * model.logits_flops_per_token / t
    logits_time = logits_exec / (peak * eff) + a.elementwise_passes * 3 * 4 * tokens * model.vocab / t / (gpu.hbm_tb_s * 1e12)

    # --- pipeline point-to-point ---------------------------------------------------------------
    pp_link = cluster.link_gbps(cluster.gpus)  # neighbours are t·d ranks apart: the network unless all in one node
    q = transfer = 0.0
    if p > 1:
        act = tokens * h * 2.0
        if cfg.sequence_parallel:
            transfer = _collective(act / t, pp_link, a)
        elif a.pp_scatter_gather and t > 1 and pp_link != cluster.intra_node_gbps:
            transfer = _collective(act / t, pp_link, a) + _collective(allgather_bytes(act, t), cluster.intra_node_gbps, a)
        else:
            transfer = _collective(act, pp_link, a)
        q = 2 * v * transfer * (1 - a.pp_overlap) + v * a.pp_engine_overhead_s  # exposed per microbatch, steady state
    fill = 2 * (p - 1) * transfer  # the first activation and the last gradient cross every boundary

    layers = model.layers / p
    first, middle, last = stage_loads(model.layers, p, v)
    layer_total = layer_compute + layer_tp
    t_avg = layers * layer_total + q + logits_time / p
    if a.uniform_stages or p == 1:
        t_max = max(first, middle) * layer_total + q + logits_time / p
    else:  # the slowest device: a full middle one, or the last with the output layer
        t_max = max(max(first, middle) * layer_total, last * layer_total + logits_time) + q
    pipe = m * t_max + (p - 1) / v * t_avg + fill

    # --- data-parallel gradient all-reduce ------------------------------------------------------
    dp_link = cluster.link_gbps(t * d)
    grads = max(params_on_gpu(model, cfg, a.uniform_stages, r) for r in (0, 1)) * a.grad_bytes
    dp = 0.0 if d == 1 else (1 - a.dp_overlap) * _collective(allreduce_bytes(grads, d), dp_link, a)

    step = pipe + dp
    time = {
        "compute": m * (layers * layer_compute + logits_time / p),
        "tp": m * layers * layer_tp,
        "pp": m * q + fill,
        "dp": dp,
    }
    time["bubble"] = pipe - time["compute"] - time["tp"] - time["pp"]
    executed = batch * model.layers * layer_exec / b * t + batch * logits_exec / b * t  # per iteration, all GPUs
    n = cluster.gpus
    names = {cluster.intra_node_gbps: "nvlink", cluster.inter_node_gbps: "network"}
    return Estimate(
        config=cfg, batch=batch, microbatches=m, step_time_s=step, time=time,
        memory=memory_breakdown(model, cfg, m, a), memory_limit=a.memory_limit(gpu.memory_gb),
        tflops_per_gpu=executed / (n * step) / 1e12,
        mfu=model.model_flops(batch * s) / (n * step * peak),
        bubble=bubble_fraction(p, m, v), efficiency=eff,
        links={"tp": names[tp_link] if t > 1 else "-", "pp": names[pp_link] if p > 1 else "-",
               "dp": names[dp_link] if d > 1 else "-"},
    )
