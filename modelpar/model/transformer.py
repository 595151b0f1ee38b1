"""The model built from the tensor-parallel layers, split into pipeline stages by hand (§3.4, §6).

    tokens ─► embed (VocabParallelEmbedding [+ learned positions, gpt]) ─► layers 0..L-1
           ─► norm (final LayerNorm / RMSNorm) ─► head (OutputLayer, column-parallel over the padded
              vocabulary, V/t per rank) ─► vocab_parallel_cross_entropy (§5.5: logits never gathered)

Pre-norm layers with causal attention (``modelpar.tensor_parallel.ParallelTransformerLayer``),
GPT-2 or Llama style (``ModelConfig.arch``). Splitting follows §3.4: build the whole model on the
meta device (no memory), delete what a stage does not hold (``layers`` is a ModuleDict keyed by
the global layer index, and ``embed``, ``norm``, ``head`` may be None), then materialise the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from modelpar._validate import check_int
from modelpar.layer_split import layer_ranges, resolve_split
from modelpar.model.config import ModelConfig
from modelpar.model.moe import moe_block
from modelpar.recompute.strategies import Strategy, plan_recompute
from modelpar.tensor_parallel import (
    KVCache,
    LayerNorm,
    ParallelTransformerLayer,
    RMSNorm,
    TensorParallelModule,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from modelpar.tensor_parallel.attention import rope_of
from modelpar.tensor_parallel.context_parallel import ContextParallel
from modelpar.tensor_parallel.head_loss import OutputLayer
from modelpar.tensor_parallel.rotary import Rope, RotaryTable

__all__ = ["LMLoss", "TokenEmbedding", "Transformer", "layers_of_stage", "split_stage"]


class TokenEmbedding(TensorParallelModule):
    """Token embedding split by vocabulary (§5.5), plus learned positions (gpt), replicated.

    With sequence parallelism the lookup is reduce-scattered along the sequence and each rank
    adds the positions of its own s/t tokens (so their gradient is summed over the group). With
    context parallelism the ids are this rank's s/cp tokens, whose positions ``context`` knows.
    """

    def __init__(self, cfg: ModelConfig, group: Any, sequence_parallel: bool, dtype: torch.dtype | None,
                 context: ContextParallel | None = None) -> None:
        super().__init__()
        self._init_tensor_parallel(group)
        self.word = VocabParallelEmbedding(cfg.padded_vocab_size, cfg.hidden, group=group,
                                           sequence_parallel=sequence_parallel, vocab_size=cfg.vocab_size, dtype=dtype)
        self.pos = nn.Parameter(torch.empty(cfg.seq_len, cfg.hidden, dtype=dtype)) if cfg.arch == "gpt" else None
        self._set_layout("pos", None, sequence_parallel=sequence_parallel)
        self.seq_len, self.sequence_parallel = cfg.seq_len, sequence_parallel
        self.context = context if context is not None and context.size > 1 else None

    def forward(self, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Ids [b, s] at positions start … start + s − 1 → [b, s, h] (sequence parallel: [b, s/t, h])."""
        if ids.dim() != 2 or start + ids.shape[1] > self.seq_len:
            raise ValueError(f"token ids must be [batch, seq] with seq <= seq_len ({self.seq_len - start}), "
                             f"got shape {tuple(ids.shape)}")
        x = self.word(ids)
        if self.pos is None:
            return x
        if self.context is not None:  # zig-zag positions; under sequence parallelism this rank's run of them
            positions = self.context.positions(ids.shape[1], ids.device)
            first = self.tp_rank * x.shape[1] if self.sequence_parallel else 0
            return x + self.pos[positions[first:first + x.shape[1]]]
        if self.sequence_parallel:  # this rank's tokens are [r·s/t, (r+1)·s/t)
            start += self.tp_rank * x.shape[1]
        return x + self.pos[start:start + x.shape[1]]


class Transformer(nn.Module):
    """The model, or one pipeline stage of it (``split_stage``): absent parts are None / missing layers.

    ``group``: the tensor-parallel group (None: one process). ``recompute``: activation
    recomputation (``modelpar.recompute.RECOMPUTE_NAMES``): ``"selective"`` re-runs every
    attention core, the others (k, "full", ...) checkpoint this module's chain of layers.
    ``context``: context parallelism (each sequence split over the cp ranks; the ids a rank gets are
    its tokens in ``modelpar.tensor_parallel.context_parallel.zigzag_index`` order).
    ``ep_group``: the expert-parallel group of the MoE layers (``cfg.moe_layers``; docs/moe.md).
    ``head_in_loss``: the last stage returns the final norm's output, and ``LMLoss(head=model.head)`` applies
    the head with the loss, in chunks of tokens (the trainer's way: the logits are never whole).
    """

    def __init__(self, cfg: ModelConfig, group: Any = None, sequence_parallel: bool = False,
                 recompute: Strategy = None, dtype: torch.dtype | None = None,
                 context: ContextParallel | None = None, ep_group: Any = None, head_in_loss: bool = False) -> None:
        super().__init__()
        self.cfg, self.head_in_loss = cfg, head_in_loss
        selective = recompute == "selective"
        self.recompute = None if (selective or recompute == "none") else recompute
        if self.recompute is not None:
            plan_recompute(cfg.layers, self.recompute)  # a bad name fails here, before any work
        llama = cfg.arch == "llama"
        kw: dict[str, Any] = {"group": group, "sequence_parallel": sequence_parallel, "dtype": dtype}
        self.embed: TokenEmbedding | None = TokenEmbedding(cfg, group, sequence_parallel, dtype, context)
        self.layers = nn.ModuleDict({
            str(i): ParallelTransformerLayer(cfg.hidden, cfg.heads, cfg.ffn_hidden, eps=cfg.norm_eps, llama=llama,
                                             kv_heads=cfg.num_kv_heads, rope_theta=cfg.rope_theta,
                                             recompute_core=selective, context=context, **kw)
            for i in range(cfg.layers)})
        for i in cfg.moe_layers:  # the MLP of these layers becomes a mixture of experts
            self.layers[str(i)].mlp = moe_block(cfg, group, ep_group, dtype)
        self.norm: nn.Module | None = (RMSNorm if llama else LayerNorm)(cfg.hidden, eps=cfg.norm_eps, **kw)
        self.head: OutputLayer | None = OutputLayer(cfg.hidden, cfg.padded_vocab_size, bias=False, **kw)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.word.weight  # the same [V/t, h] shard layout
        # one rotary table for every layer: computed once per length, device and dtype, not per layer and forward
        self.rotary = RotaryTable(cfg.hidden // cfg.heads, cfg.rope_theta) if llama else None
        self.context = context if context is not None and context.size > 1 else None
        self.shards = self.head.tp_world if sequence_parallel else 1  # a block's input is s/shards of the s tokens

    def _rope(self, x: torch.Tensor, start: int) -> Rope | None:
        """The rotary cos/sin of this input's positions, in the dtype the layers' q and k will have."""
        if self.rotary is None or not len(self.layers):
            return None
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        return rope_of(self.rotary, start, x.shape[1] * self.shards, x.device, dtype, self.context)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Token ids (first stage) or hidden states [b, s(/t), h] in; hidden states or this rank's
        vocabulary block of the logits [b, s, V/t] (last stage) out. ``cache``: decode on a whole
        model, the ids being the positions after those already cached."""
        start = 0 if cache is None else cache.pos
        if self.embed is not None:
            x = self.embed(x, start)
        rope = self._rope(x, start)
        if cache is not None:
            for index, layer in self.layers.items():
                x = layer(x, cache.layer(int(index)), rope)
            cache.advance(x.shape[1])
        elif self.recompute is None or not len(self.layers):
            for layer in self.layers.values():
                x = layer(x, rope=rope)
        else:
            from modelpar.recompute import recompute_sequential

            x = recompute_sequential([_WithRope(layer, rope) for layer in self.layers.values()], x, self.recompute)
        if self.head is not None:
            assert self.norm is not None
            x = self.norm(x)
            if not self.head_in_loss:
                x = self.head(x)
        return x


class _WithRope(nn.Module):
    """A layer called with the forward's rotary tables, as a one-tensor module (what recomputation chains take)."""

    def __init__(self, layer: nn.Module, rope: Rope | None) -> None:
        super().__init__()
        self.layer, self.rope = layer, rope

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, rope=self.rope)


class LMLoss:
    """Mean next-token cross entropy, padded ids masked: the last stage's loss_fn.

    Given logits (a model whose head ran): ``vocab_parallel_cross_entropy`` of the whole [N, V/t] block.
    Given ``head`` (the last stage's ``OutputLayer``, its model built with ``head_in_loss``): the
    stage's output is the final norm's, and the head and cross entropy run ``chunk`` tokens at a time
    (``chunked_head_cross_entropy``: the fp32 logits are never whole), in ``compute_dtype``.
    """

    def __init__(self, vocab_size: int, group: Any = None, head: OutputLayer | None = None,
                 chunk: int = 0, compute_dtype: torch.dtype | None = None) -> None:
        self.vocab_size, self.group, self.head = vocab_size, group, head
        self.chunk, self.compute_dtype = chunk, compute_dtype
        self.check_shapes = True  # the cross-rank shape check (a training loop turns it off after step 1)

    def __call__(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            loss = vocab_parallel_cross_entropy(out, targets, self.group, vocab_size=self.vocab_size,
                                                check_shapes=self.check_shapes)
            self.check_shapes = self.check_shapes and self.group is not None  # one rank: the ids checked once
            return loss
        return self.head(out, targets, vocab_size=self.vocab_size, chunk=self.chunk, compute_dtype=self.compute_dtype)


def layers_of_stage(cfg: ModelConfig, stage: int, num_stages: int, split: Sequence[int] | None = None) -> range:
    """Global indices of the layers of (virtual) stage ``stage`` of ``num_stages``.

    ``split``: the layers of each stage (``--stage-layers``); None: ``modelpar.layer_split``'s default.
    """
    check_int("stage", stage, minimum=0, maximum=num_stages - 1)
    return layer_ranges(resolve_split(cfg.layers, num_stages, 1, split))[stage]


def split_stage(model: Transformer, stage: int, num_stages: int, split: Sequence[int] | None = None) -> Transformer:
    """Keep only what (virtual) stage ``stage`` of ``num_stages`` holds, in place (§3.4).

    The first stage keeps the embedding, the last the final norm and the head (either may hold
    no layer). A tied head on a last stage without the embedding keeps the weight as its own parameter.
    """
    keep = {str(i) for i in layers_of_stage(model.cfg, stage, num_stages, split)}
    for name in [n for n in model.layers if n not in keep]:
        del model.layers[name]
    if stage != 0:
        model.embed = None
    if stage != num_stages - 1:
        model.norm = model.head = None
    return model
