"""After the pipeline's backward: make every rank's gradients those of the single-process model.

Order (Megatron's ``finalize_model_grads``):
1. tensor parallelism: sum the partial gradients over the tp group (norms and row biases under
   sequence parallelism, key/value heads replicated when t > kv heads);
2. tied embeddings split across stages: sum the first stage's embedding gradient and the last
   stage's head gradient over the embedding group (they are one weight in the model);
3. data parallelism: average over the dp group, a few flat buckets at a time (one all-reduce each);
4. clipping: the global L2 norm over all shards — each distinct tp shard counted once,
   replicated parameters once, every pp stage included, dp replicas counted once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from modelpar.model import Transformer
from modelpar.tensor_parallel import param_layout, sync_tensor_parallel_grads

__all__ = ["GradSync", "all_reduce_buckets", "param_groups"]

BUCKET_ELEMENTS = 1 << 22  # ~32 MB of float64 per all-reduce


def all_reduce_buckets(tensors: Sequence[torch.Tensor], group: Any, scale: float = 1.0,
                       bucket: int = BUCKET_ELEMENTS) -> None:
    """Sum ``tensors`` in place over ``group`` (then multiply by ``scale``), packed in flat buckets."""
    start = 0
    while start < len(tensors):
        stop, size = start, 0
        while stop < len(tensors) and (stop == start or size + tensors[stop].numel() <= bucket):
            size += tensors[stop].numel()
            stop += 1
        part = tensors[start:stop]
        flat = torch.cat([t.reshape(-1) for t in part])
        dist.all_reduce(flat, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        for t, f in zip(part, flat.split([t.numel() for t in part])):
            t.copy_(f.view_as(t))
        start = stop


@dataclass
class GradSync:
    """The gradient work of one rank: its stage modules and where they sit in the (pp, dp, tp) grid."""

    modules: Sequence[Transformer]  # this rank's stage modules (v of them when interleaved)
    tp_group: Any  # None when t = 1
    dp_group: Any  # None when d = 1
    embed_group: Any  # first and last stage of this (dp, tp) pipeline, when tied across stages
    tp_rank: int
    dp_rank: int
    dp: int
    tied_split: bool = False  # tied embeddings with the head on another stage (a separate copy)

    def __post_init__(self) -> None:
        self.params = [p for m in self.modules for p in m.parameters()]
        self.tied: list[nn.Parameter] = []  # the tied weight's copies held here (embedding, head)
        self._tied_copy: set[int] = set()
        for m in self.modules if self.tied_split else ():
            if m.embed is not None:
                self.tied.append(m.embed.word.weight)
            if m.head is not None:
                self.tied.append(m.head.weight)
                self._tied_copy.add(id(m.head.weight))

    def _grads(self, params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
        """The gradients of ``params`` (``finish`` has given every parameter one)."""
        grads = [p.grad for p in params]
        assert all(g is not None for g in grads), "call finish() first: some parameters have no gradient"
        return grads  # type: ignore[return-value]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def finish(self) -> None:
        """Steps 1-3: gradients become the full model's mean-batch gradients on every rank."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.tp_group is not None:
            for m in self.modules:
                sync_tensor_parallel_grads(m)
        if len(self.tied) == 2:  # p = 1, interleaved: both copies on this rank
            first, second = self._grads(self.tied)
            total = first + second
            for g in (first, second):
                g.copy_(total)
        elif self.tied and self.embed_group is not None:
            all_reduce_buckets(self._grads(self.tied), self.embed_group)
        if self.dp > 1:
            all_reduce_buckets(self._grads(self.params), self.dp_group, scale=1.0 / self.dp)

    def _counted(self, p: nn.Parameter) -> bool:
        if self.dp_rank != 0 or id(p) in self._tied_copy:
            return False
        layout = param_layout(p)
        return layout.rank % layout.replicas == 0 if layout.dim is not None else self.tp_rank == 0

    def global_norm(self) -> float:
        """Collective over all ranks: the L2 norm of the whole model's gradient."""
        grads = self._grads([p for p in self.params if self._counted(p)])
        ref = self.params[0]
        local = torch.zeros((), dtype=torch.float64, device=ref.device)
        for g in grads:
            local += g.detach().double().pow(2).sum()
        dist.all_reduce(local)
        return math.sqrt(local.item())

    def clip(self, max_norm: float) -> float:
        """Scale all gradients so their global norm is at most ``max_norm``; return the norm before."""
        norm = self.global_norm()
        if max_norm > 0 and norm > max_norm:
            coef = max_norm / (norm + 1e-6)
            for g in self._grads(self.params):
                g.mul_(coef)
        return norm


def param_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on matrices (embeddings too), none on biases and LayerNorm (nanoGPT's rule)."""
    params = list(params)
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
