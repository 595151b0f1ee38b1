"""What a GPU's caching allocator holds beyond the saved-tensor count: the terms behind ``max_memory_allocated``.

``local_memory`` counts what autograd keeps for the backward (``activation_bytes``) and the training state
(``state_bytes``). Under bf16 autocast on a GPU the allocator holds more; each term here is derived from
what torch does (the source named beside it) and is per rank:

- ``autocast_copy_bytes``: autocast's bf16 copy of every fp32 weight a matrix product reads, made once per
  autocast region (``cached_cast``, aten/src/ATen/autocast_mode.cpp: fp32 leaf tensors that require grad
  are cast once and cached until the outermost region exits, torch/amp/autocast_mode.py ``__exit__`` →
  ``clear_autocast_cache``) and kept by the products' backward nodes until the microbatch's backward:
  one set per held microbatch (a stage's forward is one region: ``training.precision.MixedPrecisionStage``).
  The head's weight too (the chunked loss casts it itself, ``head_loss._ChunkedHeadCrossEntropy.forward``:
  ``weight.to(compute)``, saved); norms and embeddings are not cast (not on autocast's lower-precision list),
  and a bias's copy is not kept (its gradient is a sum of the output's). Measured under CPU autocast, the
  same ``cached_cast``, in tests/unit/test_allocator.py.
- ``saved_width_bytes``: tensors the count prices at the compute dtype's width that are fp32: the
  attention's log-sum-exp (flash attention's ``softmax_lse``, ``at::kFloat``: mha_fwd in
  aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp) and, with the logits whole, the
  saved fp32 log-softmax (``F.cross_entropy`` on the upcast logits, ``cross_entropy.vocab_parallel_cross_entropy``).
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

from modelpar.costmodel.inventory import stage_buckets, stage_layers, stage_tensors
from modelpar.costmodel.local_memory import COMPUTE_BYTES, LocalLayout

__all__ = ["ALLOCATOR_BLOCK", "LOSS_CHUNK_BYTES", "AllocatorBytes", "allocator_bytes", "attention_workspace_bytes",
           "autocast_copy_bytes", "head_transient_bytes", "loss_chunk_tokens", "optimizer_step_bytes",
           "optimizer_tensors", "saved_width_bytes"]

ALLOCATOR_BLOCK = 512  # the CUDA caching allocator's smallest block (kMinBlockSize)
LOSS_CHUNK_BYTES = 256 * 2**20  # TrainConfig.loss_chunk_mb's default (tests/unit/test_allocator.py checks it)
_AUTOCAST = ("bf16",)  # precisions whose products read autocast's copies of fp32 parameters


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def autocast_copy_bytes(run: LocalLayout, stage: int) -> float:
    """Bytes of autocast's bf16 weight copies one microbatch of ``stage`` keeps until its backward (module
    docstring): 2 bytes per element of every weight a product reads and keeps for its backward, the layers'
    linears' and the head's (not the norms'; not the biases': a bias's copy, where one is made, is not kept,
    its gradient being a sum of the output's); 0 without autocast."""
    if run.precision not in _AUTOCAST:
        return 0.0
    m = run.model
    norm = m.hidden * (2 if m.bias else 1)
    elements = sum(x.numel for x in stage_tensors(run, stage))
    up = (2 if m.gated_mlp else 1) * m.ffn_size // run.t
    biases = (0 if m.gated_mlp else 3 * m.hidden // run.t) + up + 2 * m.hidden if m.bias else 0
    elements -= (2 * norm + biases) * len(stage_layers(run, stage))
    last = stage == run.stages - 1
    if stage == 0:  # the embedding and positions are looked up, not multiplied
        elements -= m.vocab // run.t * m.hidden + (m.seq * m.hidden if m.learned_positions else 0)
    if last:
        elements -= norm
        if m.tied_embeddings and run.stages == 1:  # the head reads the embedding's weight: cast once for it
            elements += m.vocab // run.t * m.hidden
    return float(elements * COMPUTE_BYTES[run.precision])


def _attention_here(run: LocalLayout, stage: int) -> bool:
    """Does ``stage`` run torch's fused attention with layers (not context parallelism's own functions)?"""
    return run.cp == 1 and len(stage_layers(run, stage)) > 0 and run.recompute != "full"


def saved_width_bytes(run: LocalLayout, stage: int) -> float:
    """Bytes one microbatch of ``stage`` keeps beyond ``activation_parts``' count because they are fp32, not the
    compute dtype (module docstring): the layers' log-sum-exp (none with selective recomputation) and, with the
    logits whole on the last stage, the saved log-softmax; 0 where the compute dtype is 4 bytes or wider."""
    e = COMPUTE_BYTES[run.precision]
    if e >= 4:
        return 0.0
    total = 0.0
    if _attention_here(run, stage) and run.recompute != "selective":
        total += len(stage_layers(run, stage)) * run.tokens * run.model.heads / run.t * (4 - e)
    if stage == run.stages - 1 and not run.chunked_loss:
        total += run.tokens * run.model.vocab / run.t * (4 - e)
    return total


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
    """A rank's allocator terms: ``per_microbatch`` (kept with every held microbatch, averaged over its stages),
    ``transient`` (the backward's largest workspace: attention or head), ``steady`` (always held)."""

    per_microbatch: float
    transient: float
    steady: float

    def peak(self, held: int) -> float:
        """Bytes beyond the state and the counted activations with ``held`` microbatch-chunks held."""
        return held * self.per_microbatch + self.transient + self.steady


def optimizer_tensors(run: LocalLayout, stages: list[int]) -> int:
    """The tensors AdamW steps on the rank holding ``stages``: its parameters, or under ZeRO its bucket ranges."""
    return sum(len(stage_buckets(run, s)) if run.zero else len(stage_tensors(run, s)) for s in stages)


def allocator_bytes(run: LocalLayout, stages: list[int]) -> AllocatorBytes:
    """The allocator terms of the rank holding ``stages`` (module docstring)."""
    per = sum(autocast_copy_bytes(run, s) + saved_width_bytes(run, s) for s in stages) / len(stages)
    transient = max(max(attention_workspace_bytes(run, s), head_transient_bytes(run, s)) for s in stages)
    return AllocatorBytes(per, transient, optimizer_step_bytes(optimizer_tensors(run, stages)))
