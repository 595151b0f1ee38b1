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

The byte and overlap rules are pure functions of plain numbers (``kv_block_bytes``, ``cp_blocks``,
``cp_exposed``), shared with the trainer's own prediction (``costmodel.local``).
"""

from __future__ import annotations

from modelpar.costmodel.assumptions import Assumptions
from modelpar.costmodel.measured import collective_time
from modelpar.costmodel.specs import ClusterSpec, ModelSpec, ParallelConfig
from modelpar.formulas import allgather_bytes

__all__ = ["cp_block_bytes", "cp_blocks", "cp_bytes_per_layer", "cp_exposed", "cp_layer_time", "kv_block_bytes"]


def kv_block_bytes(micro_batch: int, seq: int, cp: int, kv_features: float, value_bytes: float) -> float:
    """Bytes of one cp rank's key/value block of one layer and micro-batch: 2·b·(s/cp)·kv_features values
    (kv_features: the key (or value) features a rank holds, h·g/a/t)."""
    return 2.0 * micro_batch * seq / cp * kv_features * value_bytes


def cp_blocks(cp: int, cp_comm: str, recompute: str) -> tuple[int, int]:
    """Key/value blocks a cp rank sends per layer and micro-batch, (forward, backward); 0 at cp = 1.

    ring: (cp − 1) key/value hops forward; (cp − 1) hops and cp gradient hops backward. allgather: an
    all-gather and a reduce-scatter of cp blocks, (cp − 1) blocks each. A full recomputation repeats the forward's.
    """
    if cp == 1:
        return 0, 0
    forward = (cp - 1) * (2 if recompute == "full" else 1)
    return forward, (2 * cp - 1 if cp_comm == "ring" else cp - 1)


def cp_exposed(cp: int, cp_comm: str, recompute: str, comm_s: float, block_s: float) -> tuple[float, float]:
    """Exposed cp seconds of one layer and micro-batch, (forward, backward — a full recomputation's repeated
    forward included): ``comm_s`` is one ring hop of a block (ring) or the forward's all-gather (allgather),
    ``block_s`` one block's attention forward. The ring overlaps each hop with a block (backward: a block and its
    gradient beside the block's backward, 2 × forward; the last gradient hop exposed); the all-gather and its
    reduce-scatter overlap nothing."""
    if cp == 1:
        return 0.0, 0.0
    again = 1 if recompute == "full" else 0
    if cp_comm == "allgather":
        return comm_s, comm_s * (1 + again)  # the backward's reduce-scatter moves as much
    forward = (cp - 1) * max(0.0, comm_s - block_s)
    backward = (cp - 1) * max(0.0, 2 * comm_s - 2 * block_s) + comm_s  # the block and its gradient; the last hop
    return forward, backward + forward * again


def cp_block_bytes(model: ModelSpec, cfg: ParallelConfig, a: Assumptions) -> float:
    """Bytes of one cp rank's key/value block of one layer and micro-batch: 2·b·(s/cp)·h·(g/a)/t values."""
    return kv_block_bytes(cfg.micro_batch, model.seq, cfg.cp, model.hidden * model.kv_fraction / cfg.t, a.param_bytes)


def cp_bytes_per_layer(model: ModelSpec, cfg: ParallelConfig, a: Assumptions) -> float:
    """Bytes a cp rank sends for one layer and micro-batch, forward and backward (0 at cp = 1; ``cp_blocks``)."""
    return sum(cp_blocks(cfg.cp, cfg.cp_comm, cfg.recompute)) * cp_block_bytes(model, cfg, a)


def cp_layer_time(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, a: Assumptions, eff: float) -> float:
    """Exposed context-parallel communication of one layer and micro-batch on one GPU (seconds; ``cp_exposed``)."""
    if cfg.cp == 1:
        return 0.0
    c, span = cfg.cp, cfg.t * cfg.cp
    kv, link = cp_block_bytes(model, cfg, a), cluster.link_gbps(span)
    if cfg.cp_comm == "allgather":
        comm = collective_time(allgather_bytes(c * kv, c), link, a, cluster, "all_gather", c, span)
    else:
        comm = collective_time(kv, link, a, cluster, "p2p", 2, span)
    block = 4.0 * cfg.micro_batch * (model.seq / c) ** 2 * model.hidden / cfg.t / (cluster.gpu.peak_tflops * 1e12 * eff)
    return sum(cp_exposed(c, cfg.cp_comm, cfg.recompute, comm, block))
