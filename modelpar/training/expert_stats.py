"""Per-step routing statistics of the mixture-of-experts layers, summed over every rank, for metrics.jsonl.

Each ``MoE`` layer counts, in the training forward of each micro-batch (``modelpar.model.moe``), the
tokens routed to each expert (before dropping), the dropped assignments and its load-balancing
loss. After a step one all-reduce over the world sums them (tensor-parallel ranks, which compute
the same routing, contribute once); every rank gets the same figures.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from modelpar.model.moe import moe_modules
from modelpar.training.config import TrainConfig

__all__ = ["ExpertStats", "imbalance"]


def imbalance(tokens: list[float]) -> float:
    """max / mean tokens per expert (1: perfectly balanced; 0 when no token was routed)."""
    mean = sum(tokens) / len(tokens)
    return max(tokens) / mean if mean else 0.0


class ExpertStats:
    """Collects this rank's MoE layers' statistics; ``take_step`` returns the step's figures (or {} without experts)."""

    def __init__(self, cfg: TrainConfig, modules: Mapping[int, nn.Module], tp_rank: int, device: torch.device) -> None:
        self.layers = list(cfg.model.moe_layers)
        self.experts, self.device, self.tp_rank = cfg.model.experts, device, tp_rank
        self.held = [(self.layers.index(int(name.split(".")[1])), m) for module in modules.values()
                     for name, m in moe_modules(module)]
        for _, m in self.held:
            m.aux_rows = cfg.batch_size // cfg.dp  # the aux loss is a mean over the replica's sequences

    def reset(self) -> None:
        for _, m in self.held:
            m.take_stats()

    def take_step(self) -> dict[str, Any]:
        if not self.layers:
            return {}
        rows = torch.zeros(len(self.layers), self.experts + 3, dtype=torch.float64, device=self.device)
        for index, m in self.held:
            stats = m.take_stats().to(self.device)
            if self.tp_rank == 0:
                rows[index] += stats
        dist.all_reduce(rows)
        tokens = rows[:, :self.experts].tolist()
        sequences = rows[:, -1].clamp(min=1)
        return {"aux_loss": (rows[:, -2] / sequences).mean().item(),
                "expert_tokens": [[int(t) for t in layer] for layer in tokens],
                "dropped_tokens": int(rows[:, self.experts].sum().item()),
                "expert_imbalance": max(imbalance(layer) for layer in tokens)}
