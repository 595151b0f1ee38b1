"""A GPT built from the tensor-parallel layers, split into pipeline stages by hand (§3.4, §6).

    tokens ─► embed (VocabParallelEmbedding + learned positions) ─► layers 0..L-1
           ─► norm (final LayerNorm) ─► head (ColumnParallelLinear over the vocabulary, V/t per rank)
           ─► vocab_parallel_cross_entropy (§5.5: the logits are never gathered)

Pre-LN layers with causal attention (``modelpar.tensor_parallel.ParallelTransformerLayer``).
Splitting follows §3.4: build the whole model on the meta device (no memory), delete what a stage
does not hold (``layers`` is a ModuleDict keyed by the global layer index, and ``embed``, ``norm``,
``head`` may be None), then materialise only the rest. ``init_parameters`` fills each parameter
from a seeded *full* tensor and keeps this rank's shard, so every (t, p, d) split starts from
exactly the single-process model's weights.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modelpar._validate import check_divisible, check_int
from modelpar.tensor_parallel import (
    ColumnParallelLinear,
    LayerNorm,
    ParallelTransformerLayer,
    VocabParallelEmbedding,
    scatter_to_sequence_parallel_region,
    shard_tensor,
    vocab_parallel_cross_entropy,
)
from modelpar.tensor_parallel.sharding import param_layout

__all__ = ["GPT", "GPTLoss", "ModelConfig", "build_stage", "global_name", "init_parameters", "split_stage",
           "stage_layers"]

TIED_INIT_NAME = "embed.word.weight"  # the last stage's copy of a tied embedding is seeded like the first's


@dataclass(frozen=True)
class ModelConfig:
    """GPT shape. Defaults: the `modelpar train` demo model (867,072 parameters, byte vocabulary)."""

    vocab_size: int = 256  # V: tokens (bytes); divisible by t (vocabulary-parallel embedding and head)
    seq_len: int = 64  # s: context length, also the number of learned positions
    hidden: int = 128  # h: model width; divisible by heads
    heads: int = 4  # a: attention heads; divisible by t (heads are split across ranks)
    layers: int = 4  # L: transformer layers; divisible by the number of (virtual) stages p·v
    ffn_mult: int = 4  # MLP width = ffn_mult·h; ffn_mult·h divisible by t
    tie_embeddings: bool = False  # output layer reuses the input embedding (summed across stages if p > 1)
    init_std: float = 0.02  # N(0, std) for weights (GPT-2); output projections scaled by 1/√(2L)

    @property
    def ffn_hidden(self) -> int:
        return self.ffn_mult * self.hidden

    def num_parameters(self) -> int:
        """Parameters of the single-process model (a tied head counts once)."""
        h, f, v, s, n = self.hidden, self.ffn_hidden, self.vocab_size, self.seq_len, self.layers
        layer = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
        return v * h + s * h + n * layer + 2 * h + (0 if self.tie_embeddings else v * h)

    def check(self, tp: int = 1, stages: int = 1, sequence_parallel: bool = False) -> ModelConfig:
        """Raise ValueError unless the shape splits across t ranks and ``stages`` (p·v) stages."""
        for name in ("vocab_size", "seq_len", "hidden", "heads", "layers", "ffn_mult"):
            check_int(name, getattr(self, name), minimum=1)
        check_divisible("hidden", self.hidden, "heads", self.heads)
        check_divisible("heads", self.heads, "tp", tp)
        check_divisible("vocab_size", self.vocab_size, "tp", tp)
        check_divisible("ffn hidden size (ffn_mult * hidden)", self.ffn_hidden, "tp", tp)
        check_divisible("layers", self.layers, "the number of pipeline stages (pp * chunks)", stages)
        if sequence_parallel:
            check_divisible("seq_len (sequence parallel)", self.seq_len, "tp", tp)
        return self


class GPTEmbedding(nn.Module):
    """Token embedding split by vocabulary (§5.5) plus learned positions, replicated.

    With sequence parallelism the sum is then cut along the sequence (as Megatron does: the
    positions are added to the full sequence, then each rank keeps its s/t tokens).
    """

    def __init__(self, cfg: ModelConfig, group: Any, sequence_parallel: bool, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.word = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, group=group, dtype=dtype)
        self.pos = nn.Parameter(torch.empty(cfg.seq_len, cfg.hidden, dtype=dtype))
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.shape[1] > self.pos.shape[0]:
            raise ValueError(f"token ids must be [batch, seq] with seq <= seq_len ({self.pos.shape[0]}), "
                             f"got shape {tuple(ids.shape)}")
        x = self.word(ids) + self.pos[: ids.shape[1]]
        return scatter_to_sequence_parallel_region(x, self.group) if self.sequence_parallel else x


class GPT(nn.Module):
    """The GPT, or one pipeline stage of it (``split_stage``): absent parts are None / missing layers.

    ``group``: the tensor-parallel group (None: one process). ``recompute``: None, "full" or k,
    activation recomputation over this module's layers (``modelpar.recompute``).
    """

    def __init__(self, cfg: ModelConfig, group: Any = None, sequence_parallel: bool = False,
                 recompute: str | int | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.cfg, self.recompute = cfg, recompute
        kw: dict[str, Any] = {"group": group, "sequence_parallel": sequence_parallel, "dtype": dtype}
        self.embed: GPTEmbedding | None = GPTEmbedding(cfg, group, sequence_parallel, dtype)
        self.layers = nn.ModuleDict({str(i): ParallelTransformerLayer(cfg.hidden, cfg.heads, cfg.ffn_hidden, **kw)
                                     for i in range(cfg.layers)})
        self.norm: LayerNorm | None = LayerNorm(cfg.hidden, **kw)
        self.head: ColumnParallelLinear | None = ColumnParallelLinear(cfg.hidden, cfg.vocab_size, bias=False, **kw)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.word.weight  # the same [V/t, h] shard layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states [b, s(/t), h] in; hidden states or this rank's
        vocabulary block of the logits [b, s, V/t] (last stage) out."""
        if self.embed is not None:
            x = self.embed(x)
        if len(self.layers):
            if self.recompute is None:
                for layer in self.layers.values():
                    x = layer(x)
            else:
                from modelpar.recompute import recompute_sequential

                x = recompute_sequential(list(self.layers.values()), x, self.recompute)
        if self.head is not None:
            assert self.norm is not None
            x = self.head(self.norm(x))
        return x


class GPTLoss:
    """Mean next-token cross entropy of vocabulary-parallel logits: the last stage's loss_fn."""

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.group)


def stage_layers(cfg: ModelConfig, stage: int, num_stages: int) -> range:
    """Global indices of the layers of (virtual) stage ``stage``: L / num_stages consecutive ones."""
    check_divisible("layers", cfg.layers, "the number of pipeline stages (pp * chunks)", num_stages)
    check_int("stage", stage, minimum=0, maximum=num_stages - 1)
    per = cfg.layers // num_stages
    return range(stage * per, (stage + 1) * per)


def split_stage(model: GPT, stage: int, num_stages: int) -> GPT:
    """Keep only what (virtual) stage ``stage`` of ``num_stages`` holds, in place (§3.4).

    The first stage keeps the embedding, the last the final LayerNorm and the head. A tied
    head on a last stage without the embedding keeps the weight as its own parameter.
    """
    keep = {str(i) for i in stage_layers(model.cfg, stage, num_stages)}
    for name in [n for n in model.layers if n not in keep]:
        del model.layers[name]
    if stage != 0:
        model.embed = None
    if stage != num_stages - 1:
        model.norm = model.head = None
    return model


def _seed_for(seed: int, name: str) -> int:
    """A 63-bit generator seed that depends only on the run seed and the parameter's full name."""
    return (check_int("seed", seed, minimum=0) * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63 - 1)


def _full_init(cfg: ModelConfig, name: str, module: nn.Module, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The single-process value of parameter ``name`` (float64), GPT-2's scheme."""
    leaf = name.rsplit(".", 1)[-1]
    if isinstance(module, nn.LayerNorm):
        return torch.ones(shape, dtype=torch.float64) if leaf == "weight" else torch.zeros(shape, dtype=torch.float64)
    if leaf == "bias":
        return torch.zeros(shape, dtype=torch.float64)
    std = cfg.init_std
    if name.endswith((".proj.weight", ".fc2.weight")):  # residual-branch outputs (GPT-2 §2.3)
        std /= math.sqrt(2 * cfg.layers)
    g = torch.Generator().manual_seed(_seed_for(seed, name))
    return torch.randn(shape, generator=g, dtype=torch.float64) * std


def global_name(cfg: ModelConfig, name: str) -> str:
    """The name a stage's parameter has in the single-process model: its own name (layer indices
    are global), except that a last stage's copy of a tied output weight is the embedding."""
    return TIED_INIT_NAME if cfg.tie_embeddings and name == "head.weight" else name


@torch.no_grad()
def init_parameters(model: GPT, seed: int) -> GPT:
    """Fill every parameter with its shard of a seeded full tensor: the same values for any split."""
    for mod_name, module in model.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            name = global_name(model.cfg, f"{mod_name}.{leaf}" if mod_name else leaf)
            layout = param_layout(param)
            shape = list(param.shape)
            if layout.dim is not None:
                shape[layout.dim] *= layout.shards
            full = _full_init(model.cfg, name, module, tuple(shape), seed)
            if layout.dim is not None and layout.shards > 1:
                full = shard_tensor(full, layout.dim, layout.shard, layout.shards, layout.blocks)
            param.copy_(full)
    return model


def build_stage(cfg: ModelConfig, stage: int = 0, num_stages: int = 1, *, seed: int = 0, group: Any = None,
                sequence_parallel: bool = False, recompute: str | int | None = None,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> GPT:
    """Stage ``stage`` of ``num_stages`` on this rank: built on meta, split, then only it materialised."""
    with torch.device("meta"):
        model = GPT(cfg, group=group, sequence_parallel=sequence_parallel, recompute=recompute, dtype=dtype)
    split_stage(model, stage, num_stages)
    model.to_empty(device=device)
    if cfg.tie_embeddings and model.embed is not None and model.head is not None:
        model.head.weight = model.embed.word.weight  # to_empty gives shared parameters separate storage
    return init_parameters(model, seed)
