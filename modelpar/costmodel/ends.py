"""The pipeline's ends, priced for the stage that runs them (the published-run pricer, ``estimate.py``).

The first stage runs the input embedding, whose backward writes a dense [V/t, h] gradient; the last
the output layer (2·h·V/t FLOPs per token forward, twice backward) and the cross entropy over the
fp32 logits, memory-bound; with tied embeddings and p > 1 the two stages all-reduce the word
embedding's gradient every step. ``memory.end_working_bytes`` holds their memory. Sources beside
each term; docs/costmodel.md ("The pipeline's ends").
"""

from __future__ import annotations

from modelpar.costmodel.assumptions import Assumptions
from modelpar.costmodel.inventory import embedding_elements
from modelpar.costmodel.measured import collective_time
from modelpar.costmodel.network import ring_time
from modelpar.costmodel.specs import ClusterSpec, ModelSpec, ParallelConfig
from modelpar.formulas import allreduce_bytes

__all__ = ["CROSS_ENTROPY_BYTES", "embedding_sync", "embedding_time", "hbm_seconds", "output_layer_time"]


def hbm_seconds(nbytes: float, cluster: ClusterSpec) -> float:
    """Seconds to stream ``nbytes`` through the GPU's memory at its data-sheet bandwidth."""
    return nbytes / (cluster.gpu.hbm_tb_s * 1e12)


# Bytes per logit through HBM in Megatron-LM's vocabulary-parallel cross entropy (megatron/core/tensor_parallel/
# cross_entropy.py, _VocabParallelCrossEntropy), counted from its kernels: forward — the 16-bit logits to fp32 (read 2,
# write 4), their max (read 4), minus it in place (4 + 4), exp in place (4 + 4), the sum (read 4); backward — ÷ the
# sum in place (4 + 4), × the loss gradient in place (4 + 4), the 16-bit gradient for the head's GEMMs (read 4, write 2).
CROSS_ENTROPY_BYTES = 52.0


def _tp_one(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, a: Assumptions, values: float = 0.0) -> float:
    """One tensor-parallel all-reduce of b·s·h 16-bit values (or of ``values`` fp32 values) over the t ranks."""
    tokens = cfg.micro_batch * model.seq / cfg.cp
    nbytes = values * 4 if values else tokens * model.hidden * a.param_bytes
    return collective_time(allreduce_bytes(nbytes, cfg.t), cluster.link_gbps(cfg.t), a, cluster, "all_reduce", cfg.t)


def output_layer_time(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, a: Assumptions, eff: float
                      ) -> float:
    """The last stage's end, one microbatch: the vocabulary-parallel output layer (2·h·V/t FLOPs per token forward,
    twice that backward) and, but for the reference's uniform stages (matmuls only), the fused cross entropy
    over the fp32 logits (``CROSS_ENTROPY_BYTES`` per logit, memory-bound) and at t > 1 its collectives: the
    head's input gathered (SP) in the forward, its input gradient all-reduced (SP: reduce-scatter) in the
    backward, under the weight-gradient GEMM as the layers' are (``tp_overlap``), and the cross entropy's
    three all-reduces of one fp32 value per token (max, target logit, sum)."""
    tokens = cfg.micro_batch * model.seq / cfg.cp
    flops = 3 * tokens * model.logits_flops_per_token / cfg.t
    logits = tokens * model.vocab / cfg.t
    own = flops / (cluster.gpu.peak_tflops * 1e12 * eff)
    if a.uniform_stages:  # the reference's model: the output layer's matmuls, nothing else
        return own
    own += hbm_seconds(CROSS_ENTROPY_BYTES * logits, cluster)
    if cfg.t == 1:
        return own
    head = (0.5 + 0.5 * (1 - a.tp_overlap)) if cfg.sequence_parallel else 1 - a.tp_overlap
    return own + head * _tp_one(model, cluster, cfg, a) + 3 * _tp_one(model, cluster, cfg, a, tokens)


def embedding_time(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, a: Assumptions) -> float:
    """The first stage's end, one microbatch: the input embedding's backward writes a dense [V/t, h] gradient
    (torch's embedding_dense_backward zeroes it, then adds the tokens' rows), which a hook then adds into the
    gradient buffer (Megatron: the embedding has no fused weight-gradient GEMM) unless ``grad_accumulation_pass``
    already prices that pass for all the rank's weights; at t > 1 the all-reduce (SP: reduce-scatter) of its output."""
    if a.uniform_stages:  # the reference's model: no matmuls here, nothing else timed
        return 0.0
    table = embedding_elements(model, cfg.t)
    hbm = table * a.param_bytes
    if not a.grad_accumulation_pass:
        hbm += table * (a.param_bytes + 2 * a.grad_bytes)
    tp = (0.5 if cfg.sequence_parallel else 1.0) * _tp_one(model, cluster, cfg, a) if cfg.t > 1 else 0.0
    return hbm_seconds(hbm, cluster) + tp


def embedding_sync(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, a: Assumptions) -> float:
    """With tied embeddings and p > 1, the word embedding's gradient all-reduced between the first and the last
    stage after the last backward (Megatron's finalize_model_grads, _allreduce_embedding_grads), over the network
    unless the whole job is one node; exposed: the optimizer waits for it."""
    if cfg.p == 1 or not model.tied_embeddings or a.uniform_stages:
        return 0.0
    table = embedding_elements(model, cfg.t) * a.grad_bytes
    return ring_time(allreduce_bytes(table, 2), "all_reduce", 2, cluster.gpus // 2, cluster, a)


