"""The output layer and its cross entropy in chunks of tokens: the fp32 logits are never whole.

The plain last stage computes logits [N, V/t] for all N tokens of a microbatch, upcasts them to
fp32 and keeps the softmax for the backward: N·V/t·4 bytes live at once (a 128k vocabulary at 8k
tokens: 4 GiB). Here the head's matrix product and the vocabulary-parallel cross entropy
(``cross_entropy.py``: max, Σexp and target logit all-reduced over t) run on ``chunk`` tokens at a
time; the forward keeps the head's input and one log-sum-exp per token, and the backward computes
each chunk's logits again (one more head product, as Liger-Kernel's and torchtune's chunked
losses trade) to form softmax − one-hot and the two gradient products. Under t the input passes
f (or ḡ under sequence parallelism) first, so the input gradient is summed over the group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Function

from modelpar.tensor_parallel import collectives as C
from modelpar.tensor_parallel._comm import all_reduce, group_rank
from modelpar.tensor_parallel.layers import ColumnParallelLinear, token_ids_error

__all__ = ["OutputLayer", "chunk_tokens", "chunked_head_cross_entropy"]


def chunk_tokens(budget_bytes: float, vocab_per_rank: int, dtype: torch.dtype) -> int:
    """Tokens per chunk so that one chunk's logits (in the loss's dtype) take at most ``budget_bytes``."""
    return max(1, int(budget_bytes // (vocab_per_rank * _loss_dtype(dtype).itemsize)))


def _loss_dtype(compute: torch.dtype) -> torch.dtype:
    """The cross entropy's dtype: float32, or float64 for a float64 run (16-bit logits are upcast)."""
    return torch.promote_types(compute, torch.float32)


class _ChunkedHeadCrossEntropy(Function):
    """Per-token losses [N] of the head's logits (x [N, h] · weightᵀ, this rank's V/t rows), in chunks."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup | None,
                vocab_size: int, ignore_index: int, chunk: int, compute: torch.dtype) -> torch.Tensor:
        w, xs = weight.to(compute), x.to(compute)  # what autocast would hand the head's matrix product
        start = group_rank(group) * w.shape[0]
        local, owned = _local_targets(target, start, w.shape[0])
        losses = torch.empty(x.shape[0], dtype=_loss_dtype(compute), device=x.device)
        lse = torch.empty_like(losses)
        for lo in range(0, x.shape[0], chunk):
            hi = min(lo + chunk, x.shape[0])
            z = _logits(xs[lo:hi], w, start, vocab_size)
            zmax = all_reduce(z.max(dim=-1).values, group, "forward", op="max")
            z -= zmax.unsqueeze(-1)
            picked = z.gather(-1, local[lo:hi].unsqueeze(-1)).squeeze(-1).masked_fill_(~owned[lo:hi], 0.0)
            picked = all_reduce(picked, group, "forward")
            sum_exp = all_reduce(z.exp_().sum(dim=-1), group, "forward")
            torch.log(sum_exp, out=lse[lo:hi])
            torch.sub(lse[lo:hi], picked, out=losses[lo:hi])
            lse[lo:hi] += zmax
        losses.masked_fill_(target == ignore_index, 0.0)
        ctx.save_for_backward(xs, w, target, lse)
        ctx.group, ctx.vocab_size, ctx.ignore_index, ctx.chunk = group, vocab_size, ignore_index, chunk
        ctx.dtypes = (x.dtype, weight.dtype)
        return losses

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor) -> tuple[Any, ...]:
        xs, w, target, lse = ctx.saved_tensors
        start = group_rank(ctx.group) * w.shape[0]
        local, owned = _local_targets(target, start, w.shape[0])
        scale = grad_losses.masked_fill(target == ctx.ignore_index, 0.0).to(lse.dtype)
        grad_x = torch.empty_like(xs)
        grad_w = torch.zeros(w.shape, dtype=lse.dtype, device=w.device)
        for lo in range(0, xs.shape[0], ctx.chunk):
            hi = min(lo + ctx.chunk, xs.shape[0])
            p = _logits(xs[lo:hi], w, start, ctx.vocab_size)
            p = p.sub_(lse[lo:hi].unsqueeze(-1)).exp_()  # the softmax
            rows = torch.arange(hi - lo, device=p.device)
            p[rows, local[lo:hi]] -= owned[lo:hi].to(p.dtype)
            g = p.mul_(scale[lo:hi].unsqueeze(-1)).to(xs.dtype)
            torch.mm(g, w, out=grad_x[lo:hi])
            grad_w += (g.t() @ xs[lo:hi]).to(grad_w.dtype)
        x_dtype, w_dtype = ctx.dtypes
        return grad_x.to(x_dtype), grad_w.to(w_dtype), None, None, None, None, None, None


def _local_targets(target: torch.Tensor, start: int, per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each target's column in this rank's block, 0 where another rank owns it; whether this rank owns it)."""
    owned = (target >= start) & (target < start + per_rank)
    return (target - start).masked_fill(~owned, 0), owned


def _logits(xs: torch.Tensor, w: torch.Tensor, start: int, vocab_size: int) -> torch.Tensor:
    """One chunk's logits in the loss's dtype, padded vocabulary ids (≥ ``vocab_size``) at −inf."""
    z = (xs @ w.t()).to(_loss_dtype(xs.dtype))
    if start + w.shape[0] > vocab_size:
        z[:, max(0, vocab_size - start):] = float("-inf")
    return z


def chunked_head_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, group: Any = None, *,
                               vocab_size: int, chunk: int, compute_dtype: torch.dtype | None = None,
                               ignore_index: int = -100) -> torch.Tensor:
    """Mean cross entropy of the logits x·weightᵀ over the non-ignored targets, ``chunk`` tokens at a time.

    ``x``: [..., h], the head's input as every rank of ``group`` holds it (after f / ḡ); ``weight``:
    this rank's [V/t, h] rows of the head; ``target``: [...] full-vocabulary ids. ``compute_dtype``:
    the matrix products' dtype (bf16 under mixed precision; default the weight's). Equals
    ``vocab_parallel_cross_entropy(x @ weightᵀ, target)``, forward and backward.
    """
    compute = compute_dtype or weight.dtype
    with torch.autocast(x.device.type, enabled=False):
        losses = _ChunkedHeadCrossEntropy.apply(x.reshape(-1, x.shape[-1]), weight, target.reshape(-1), group,
                                                vocab_size, ignore_index, chunk, compute)
    return losses.sum() / (target != ignore_index).sum()


class OutputLayer(ColumnParallelLinear):
    """The vocabulary-parallel head: ``ColumnParallelLinear`` h → V/t, which with targets returns the loss.

    ``layer(x)``: this rank's logits [..., V/t]. ``layer(x, target, chunk=..., compute_dtype=...)``: the mean
    cross entropy, ``chunk`` tokens at a time (``chunked_head_cross_entropy``). The loss goes through the
    module's call, so hooks on the head (ZeRO-3's gathers) run around it as around any forward.
    """

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None, *, vocab_size: int | None = None,
                chunk: int = 0, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
        if target is None:
            return super().forward(x)
        x = C.enter_column_parallel_region(x, self.group, self.sequence_parallel, self.check_shapes)
        vocab = self.out_features if vocab_size is None else vocab_size
        if self.check_shapes:  # the ids are read on the host once (as the plain loss does while checks are on)
            error = token_ids_error("target", target, vocab, -100)
            if error or tuple(target.shape) != tuple(x.shape[:-1]):
                raise ValueError(error or f"target must have the shape of the logits without their last dimension "
                                          f"{tuple(x.shape[:-1])}, got {tuple(target.shape)}")
            self.check_shapes = self.tp_world > 1  # one rank: the ids checked once (see VocabParallelEmbedding)
        return chunked_head_cross_entropy(x, self.weight, target, self.group, vocab_size=vocab,
                                          chunk=chunk or x.shape[:-1].numel(), compute_dtype=compute_dtype)
