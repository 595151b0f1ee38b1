"""Context parallelism in the cost model: what a cp rank sends per layer, and how much of it attention hides.

A cp rank holds s/cp tokens of every sequence (docs/context_parallel.md), so its activations, its
matmuls and the tensor-parallel, pipeline and output-layer traffic are those of s/cp tokens, while
each token still attends to the whole sequence (the 4·s·h attention FLOPs per token are unchanged).
Per layer and micro-batch its key/value block is kv = 2·b·(s/cp)·(h·g/a)/t 16-bit values.

- ring: forward, cp − 1 hops of kv, each beside one block's attention (4·b·(s/cp)²·h/t FLOPs);
  backward, cp − 1 hops of kv and cp of its gradient beside the blocks' backward (2 × forward), the
  last gradient hop exposed. Exposed per hop: max(0, hop − block's attention) (the runtime's
  isend/irecv overlap); again in the forward of a full recomputation.
- allgather: forward, an all-gather of the cp blocks; backward, a reduce-scatter of their gradient;
  nothing overlaps them (Llama 3's choice: cheap with few key/value heads).

Ranks of a cp group are t apart, so a cp collective spans t·cp consecutive ranks.
"""

from __future__ import annotations

from modelpar.costmodel.assumptions import Assumptions
from modelpar.costmodel.measured import collective_time
from modelpar.costmodel.specs import ClusterSpec, ModelSpec, ParallelConfig
from modelpar.formulas import allgather_bytes

__all__ = ["cp_block_bytes", "cp_bytes_per_layer", "cp_layer_time"]


def cp_block_bytes(model: ModelSpec, cfg: ParallelConfig, a: Assumptions) -> float:
    """Bytes of one cp rank's key/value block of one layer and micro-batch: 2·b·(s/cp)·h·(g/a)/t values."""
    return 2.0 * cfg.micro_batch * model.seq / cfg.cp * model.hidden * model.kv_fraction / cfg.t * a.param_bytes


def cp_bytes_per_layer(model: ModelSpec, cfg: ParallelConfig, a: Assumptions) -> float:
    """Bytes a cp rank sends for one layer and micro-batch, forward and backward (0 at cp = 1).

    ring: (cp − 1) + (cp − 1) key/value hops and cp gradient hops; allgather: an all-gather and a
    reduce-scatter of cp blocks, (cp − 1) blocks each. A full recomputation repeats the forward's.
    """
    if cfg.cp == 1:
        return 0.0
    kv, c = cp_block_bytes(model, cfg, a), cfg.cp
    forward = (c - 1) * kv
    backward = (2 * c - 1) * kv if cfg.cp_comm == "ring" else (c - 1) * kv
    return forward * (2 if cfg.recompute == "full" else 1) + backward


def cp_layer_time(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, a: Assumptions, eff: float) -> float:
    """Exposed context-parallel communication of one layer and micro-batch on one GPU (seconds)."""
    if cfg.cp == 1:
        return 0.0
    c, span = cfg.cp, cfg.t * cfg.cp
    kv, link = cp_block_bytes(model, cfg, a), cluster.link_gbps(span)
    forwards = 2 if cfg.recompute == "full" else 1
    if cfg.cp_comm == "allgather":
        one = collective_time(allgather_bytes(c * kv, c), link, a, cluster, "all_gather", c, span)
        return one * (forwards + 1)  # the backward's reduce-scatter moves as much
    hop = collective_time(kv, link, a, cluster, "p2p", 2, span)
    block = 4.0 * cfg.micro_batch * (model.seq / c) ** 2 * model.hidden / cfg.t / (cluster.gpu.peak_tflops * 1e12 * eff)
    forward = (c - 1) * max(0.0, hop - block)
    backward = (c - 1) * max(0.0, 2 * hop - 2 * block) + hop  # the block and its gradient; the last gradient hop
    return forward * forwards + backward
