"""Building a stage and initialising it: every (t, p, d) split starts from the single-process weights.

``init_parameters`` fills each parameter from a seeded *full* tensor (seeded by the run seed and
the parameter's name) and keeps this rank's shard (``param_layout(p).shard_of``), so the values do
not depend on the split. Padded vocabulary rows start (and, masked in the loss, stay) at zero.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from modelpar._validate import check_int
from modelpar.model.config import ModelConfig
from modelpar.model.transformer import Transformer, split_stage
from modelpar.recompute.strategies import Strategy
from modelpar.tensor_parallel import param_layout
from modelpar.tensor_parallel.context_parallel import ContextParallel

__all__ = ["build_stage", "global_name", "init_parameters"]

TIED_INIT_NAME = "embed.word.weight"  # the last stage's copy of a tied embedding is seeded like the first's
_VOCAB_ROWS = ("embed.word.weight", "head.weight")


def _seed_for(seed: int, name: str) -> int:
    """A 63-bit generator seed that depends only on the run seed and the parameter's full name."""
    return (check_int("seed", seed, minimum=0) * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63 - 1)


def _full_init(cfg: ModelConfig, name: str, module: nn.Module, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The single-process value of parameter ``name`` (float64), GPT-2's scheme for both archs."""
    leaf = name.rsplit(".", 1)[-1]
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return torch.ones(shape, dtype=torch.float64) if leaf == "weight" else torch.zeros(shape, dtype=torch.float64)
    if leaf == "bias":
        return torch.zeros(shape, dtype=torch.float64)
    std = cfg.init_std
    if name.endswith((".proj.weight", ".fc2.weight", ".experts.down")):  # residual-branch outputs (GPT-2 §2.3)
        std /= math.sqrt(2 * cfg.layers)
    g = torch.Generator().manual_seed(_seed_for(seed, name))
    full = torch.randn(shape, generator=g, dtype=torch.float64) * std
    if name in _VOCAB_ROWS:
        full[cfg.vocab_size:] = 0.0  # padded ids: never looked up, never predicted
    return full


def global_name(cfg: ModelConfig, name: str) -> str:
    """The name a stage's parameter has in the single-process model: its own name (layer indices
    are global), except that a last stage's copy of a tied output weight is the embedding."""
    return TIED_INIT_NAME if cfg.tie_embeddings and name == "head.weight" else name


@torch.no_grad()
def init_parameters(model: Transformer, seed: int) -> Transformer:
    """Fill every parameter with its shard of a seeded full tensor: the same values for any split."""
    for mod_name, module in model.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            name = global_name(model.cfg, f"{mod_name}.{leaf}" if mod_name else leaf)
            layout = param_layout(param)
            full = _full_init(model.cfg, name, module, layout.full_shape(param.shape), seed)
            param.copy_(layout.shard_of(full))
    return model


def build_stage(cfg: ModelConfig, stage: int = 0, num_stages: int = 1, *, seed: int = 0, group: Any = None,
                sequence_parallel: bool = False, recompute: Strategy = None,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                split: Sequence[int] | None = None, context: ContextParallel | None = None,
                ep_group: Any = None, head_in_loss: bool = False) -> Transformer:
    """Stage ``stage`` of ``num_stages`` on this rank: built on meta, split, then only it materialised.

    ``split``: the layers of each stage (``modelpar.layer_split``; None: its default split).
    ``context``: context parallelism (``modelpar.tensor_parallel.context_parallel``).
    ``ep_group``: the expert-parallel group of the MoE layers. ``head_in_loss``: see ``Transformer``."""
    with torch.device("meta"):
        model = Transformer(cfg, group=group, sequence_parallel=sequence_parallel, recompute=recompute, dtype=dtype,
                            context=context, ep_group=ep_group, head_in_loss=head_in_loss)
    split_stage(model, stage, num_stages, split)
    model.to_empty(device=device)
    if cfg.tie_embeddings and model.embed is not None and model.head is not None:
        model.head.weight = model.embed.word.weight  # to_empty gives shared parameters separate storage
    return init_parameters(model, seed)
