"""Cross entropy over vocabulary-parallel logits without gathering them (§5.5; Megatron-LM).

loss = logsumexp(z) − z[target], and logsumexp splits over vocabulary blocks. Each rank holds
logits for V/t ids; three all-reduces of one scalar per token finish the job: the max (for a
stable exp), Σexp, and the target logit (non-zero on the one rank that owns the target).
All-gathering the logits instead would move b·s·V values per rank.

A vocabulary padded for the split (Megatron pads V to a multiple of 128·t; we pad to 64) has ids
that no token uses: with ``vocab_size`` their logits are masked to −∞ first, so they get no
probability mass, no loss and a zero gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function

from modelpar._validate import check_choice, check_int
from modelpar.tensor_parallel._comm import all_reduce, check_same_shape, group_rank, group_size, resolve_group
from modelpar.tensor_parallel.layers import TOKEN_DTYPES, token_ids_error

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(Function):
    """Per-token losses [N] from logits shards [N, V/t]; backward: softmax − one-hot, this rank's block."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup | None,
                ignore_index: int, vocab_size: int) -> torch.Tensor:
        per_rank = logits.shape[-1]
        start = group_rank(group) * per_rank
        if start + per_rank > vocab_size:  # padded ids on this rank: never predicted
            padded = torch.arange(start, start + per_rank, device=logits.device) >= vocab_size
            logits = logits.masked_fill(padded, float("-inf"))
        zmax = all_reduce(logits.max(dim=-1).values, group, "forward", op="max")
        shifted = logits - zmax.unsqueeze(-1)
        outside = (target < start) | (target >= start + per_rank)
        local = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        target_logit = all_reduce(target_logit, group, "forward")
        exp = shifted.exp_()  # reuse the buffer: it becomes the softmax saved for backward
        sum_exp = all_reduce(exp.sum(dim=-1), group, "forward")
        loss = sum_exp.log() - target_logit
        ignored = target == ignore_index
        loss = loss.masked_fill(ignored, 0.0)
        exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(exp, local, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        softmax, local, outside, ignored = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= (~outside).to(grad.dtype)
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, group: Any = None,
                                 ignore_index: int = -100, reduction: str = "mean", vocab_size: int | None = None,
                                 check_shapes: bool = True) -> torch.Tensor:
    """Cross entropy of logits split by vocabulary across ``group``: equals ``F.cross_entropy``
    of the full logits, forward and backward.

    ``logits_shard``: [..., V/t], this rank's vocabulary block (rank r holds ids r·V/t …).
    ``target``: [...], full-vocabulary ids, the same on every rank; ``ignore_index`` entries
    contribute no loss and no gradient. ``reduction``: "mean" (over non-ignored tokens, as
    ``F.cross_entropy``), "sum" or "none". 16-bit logits are computed in float32.
    ``vocab_size``: the real vocabulary when the logits are padded beyond it (default: all of them);
    the padded ids get probability 0. ``check_shapes``: compare shapes across ranks first and check
    the target ids (both read on the host, so a device sync: off, nothing in here waits for the device).
    """
    check_choice("reduction", reduction, ["mean", "sum", "none"])
    group = resolve_group(group)
    if logits_shard.dim() < 1 or tuple(target.shape) != tuple(logits_shard.shape[:-1]):
        raise ValueError(f"target must have the shape of logits_shard without its last dimension "
                         f"{tuple(logits_shard.shape[:-1])}, got {tuple(target.shape)}")
    width = logits_shard.shape[-1] * group_size(group)
    vocab = width if vocab_size is None else check_int("vocab_size", vocab_size, minimum=1, maximum=width)
    if check_shapes:  # the ids are read on the host (a device sync): only while checks are on
        check_same_shape(logits_shard, group, "logits_shard", token_ids_error("target", target, vocab, ignore_index))
    elif target.dtype not in TOKEN_DTYPES:
        raise ValueError(f"target must be an integer tensor, got dtype {target.dtype}")
    logits = logits_shard if logits_shard.dtype in (torch.float32, torch.float64) else logits_shard.float()
    if group_size(group) == 1:  # nothing to reduce over ranks: torch's fused log-softmax and NLL (fewer kernels)
        logits = logits if vocab == width else logits[..., :vocab]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=ignore_index,
                               reduction=reduction).view(target.shape if reduction == "none" else ())
    losses = _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                              group, ignore_index, vocab)
    if reduction == "none":
        return losses.view(target.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (target != ignore_index).sum()
