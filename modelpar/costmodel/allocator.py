"""What a GPU's caching allocator holds beyond the saved-tensor count: the terms behind ``max_memory_allocated``.

``local_memory`` counts what autograd keeps for the backward (``activation_bytes``: under bf16 autocast its
weight copies and the fp32 tensors among the saved ones too, on any device) and the training state
(``state_bytes``). On a GPU the allocator holds more, for a moment or for the whole run; each term here is
derived from what torch does (the source named beside it) and is per rank:

- ``attention_workspace_bytes``: flash attention's backward (mha_bwd, same file) allocates ``dq_accum``
  fp32 [b, round(s, 128), heads, round(d, 32 or 64)] and ``softmax_d`` fp32 [b, heads, round(s, 128)], and
  with fewer key/value heads than query heads ``dk_expanded``/``dv_expanded`` [b, s, heads, d] in the
  compute dtype, summed into dk, dv afterwards: transient, one layer at a time.
- ``head_transient_bytes``: the logits' gradient at the head's backward. Whole logits: nll_loss's fp32
  gradient and log-softmax's (``_log_softmax_backward_data``) live at once, 8 bytes per logit; then the
  head's weight gradient in bf16 and its fp32 copy (autocast's cast backward), 6 bytes per weight element.
  Chunked (``loss_chunk_mb``): one chunk's product in bf16 and its fp32 softmax − one-hot (6 bytes per logit
  of a chunk), the fp32 weight gradient accumulated over the chunks plus one chunk's bf16 product and its
  fp32 copy (10 bytes per weight element; ``_ChunkedHeadCrossEntropy.backward``).
- ``optimizer_step_bytes``: fused AdamW keeps each parameter's ``step`` as a 0-d fp32 tensor on the device
  (torch/optim/adam.py ``_init_group``, fused or capturable), and the allocator rounds every block up to
  512 bytes (``kMinBlockSize``, c10/cuda/CUDACachingAllocator.cpp): 512 bytes per optimizer tensor, always held.

Not modelled: the activations' gradients flowing through the backward, the products' bf16 weight
gradients inside a layer, context-parallel attention (its own blockwise functions), fp8 (its linears cast
to float8 themselves: ``training.float8``). ``costmodel.local`` adds these terms for a GPU profile only;
a CPU's memory is priced as before (no flash attention there, and no device allocator to read).
"""

from __future__ import annotations

from dataclasses import dataclass

from modelpar.costmodel.inventory import stage_layers, stage_tensors, zero_segments
from modelpar.costmodel.local_memory import COMPUTE_BYTES, LocalLayout

__all__ = ["ALLOCATOR_BLOCK", "LOSS_CHUNK_BYTES", "AllocatorBytes", "allocator_bytes", "attention_workspace_bytes",
           "head_transient_bytes", "loss_chunk_tokens", "optimizer_step_bytes", "optimizer_tensors"]

ALLOCATOR_BLOCK = 512  # the CUDA caching allocator's smallest block (kMinBlockSize)
LOSS_CHUNK_BYTES = 256 * 2**20  # TrainConfig.loss_chunk_mb's default (tests/unit/test_allocator.py checks it)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def attention_workspace_bytes(run: LocalLayout, stage: int) -> float:
    """Bytes flash attention's backward allocates for one layer of ``stage`` (module docstring; 0 where it does
    not run: a CPU, cp > 1, full recomputation's re-run included — it allocates the same, so priced the same)."""
    if run.cp != 1 or not len(stage_layers(run, stage)):
        return 0.0
    m = run.model
    b, s = run.micro_batch, m.seq
    heads = max(1, m.heads // run.t)
    d = m.hidden // m.heads
    s_round = _round_up(s, 128)
    dq_accum = b * s_round * heads * _round_up(d, 32 if d <= 128 else 64) * 4
    softmax_d = b * heads * s_round * 4
    kv_heads = max(1, (m.kv_heads or m.heads) // run.t)
    expanded = 2 * b * s * heads * d * COMPUTE_BYTES[run.precision] if kv_heads < heads else 0
    return float(dq_accum + softmax_d + expanded)


def loss_chunk_tokens(run: LocalLayout, loss_chunk_bytes: float = LOSS_CHUNK_BYTES) -> int:
    """Tokens per chunk of the chunked loss (``head_loss.chunk_tokens``: a chunk's logits in the loss's dtype within
    ``loss_chunk_bytes``), at most the microbatch's; all of them with the logits whole."""
    if not run.chunked_loss:
        return run.tokens
    loss = max(4, COMPUTE_BYTES[run.precision])
    return min(run.tokens, max(1, int(loss_chunk_bytes // (run.model.vocab // run.t * loss))))


def head_transient_bytes(run: LocalLayout, stage: int, loss_chunk_bytes: float = LOSS_CHUNK_BYTES) -> float:
    """Bytes the head's backward allocates at its peak for one microbatch (module docstring); 0 off the last
    stage. ``loss_chunk_bytes``: the chunked loss's fp32 logits per chunk (``loss_chunk_mb``)."""
    if stage != run.stages - 1:
        return 0.0
    m, e = run.model, COMPUTE_BYTES[run.precision]
    vocab, n = m.vocab // run.t, run.tokens
    loss = max(4, e)  # the loss's dtype: fp32, or fp64 for an fp64 run
    weight = vocab * m.hidden
    if not run.chunked_loss:  # nll's gradient and log-softmax's, both [n, V/t] in the loss's dtype
        logits = 2 * n * vocab * loss
        wgrad = weight * (e + loss) if e < loss else 0  # the bf16 weight gradient and its fp32 copy
        return float(max(logits, wgrad))
    chunk = loss_chunk_tokens(run, loss_chunk_bytes)
    logits = chunk * vocab * (e + loss) if e < loss else chunk * vocab * loss  # the product and the softmax
    wgrad = weight * loss + weight * (e + loss if e < loss else loss)  # accumulated + one chunk's product
    return float(logits + wgrad)


def optimizer_step_bytes(tensors: int) -> float:
    """Bytes of fused AdamW's per-tensor ``step`` counters for ``tensors`` optimizer tensors (module docstring)."""
    return float(tensors * ALLOCATOR_BLOCK)


@dataclass(frozen=True)
class AllocatorBytes:
    """A rank's allocator terms: ``transient`` (the backward's largest workspace: attention or head), ``steady``
    (always held)."""

    transient: float
    steady: float

    def peak(self) -> float:
        """Bytes beyond the state and the counted activations at the rank's peak."""
        return self.transient + self.steady


def optimizer_tensors(run: LocalLayout, stages: list[int], dp_rank: int = 0) -> int:
    """The tensors AdamW steps on the rank holding ``stages`` (at ``dp_rank`` of the d·cp group): its parameters, or
    under ZeRO each parameter's part in its ranges of the buckets (``inventory.zero_segments``)."""
    return sum(zero_segments(run, s, dp_rank) if run.zero else len(stage_tensors(run, s)) for s in stages)


def allocator_bytes(run: LocalLayout, stages: list[int]) -> AllocatorBytes:
    """The allocator terms of the rank holding ``stages`` (module docstring)."""
    transient = max(max(attention_workspace_bytes(run, s), head_transient_bytes(run, s)) for s in stages)
    return AllocatorBytes(transient, optimizer_step_bytes(optimizer_tensors(run, stages)))
