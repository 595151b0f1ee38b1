"""``Recompute``: a chain of layers as one module, with a per-stage ``recompute=`` option.

    stage = Recompute(nn.Sequential(*blocks), recompute=4)     # checkpoint every 4 blocks
    stage = Recompute(blocks, recompute="full")                 # keep the stage input only
    y = recompute_sequential(blocks, x, recompute="sqrt")       # the same, as a function

It drops into any model: a stage of ``Pipe``, a stage of the multi-process pipeline runtime, the
GPT's block stack. Under ``torch.no_grad()`` (or for ``recompute="none"``) it is a plain loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from modelpar.recompute.functions import Checkpoint, RecomputeAll, RecomputeStats, Segment, chain_parameters, run_layers
from modelpar.recompute.strategies import RecomputePlan, Strategy, plan_recompute

__all__ = ["Recompute", "recompute_sequential", "recompute_stage"]

Layer = Callable[[torch.Tensor], torch.Tensor]


def _as_chain(layers: nn.Sequential | nn.ModuleList | Sequence[Layer]) -> tuple[Layer, ...]:
    """The layers as a tuple of callables; an empty chain or a non-callable is a ValueError."""
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.Sequential, nn.ModuleList)):
        raise ValueError(f"layers must be an nn.Sequential, an nn.ModuleList or a list of callables, got {type(layers).__name__} "
                         "(wrap a single module as [module])")
    if isinstance(layers, (str, bytes)) or not isinstance(layers, (Sequence, nn.Sequential, nn.ModuleList)):
        raise ValueError(f"layers must be an nn.Sequential, an nn.ModuleList or a list of callables, got {type(layers).__name__}")
    chain: tuple[Layer, ...] = tuple(layers)
    if not chain:
        raise ValueError("layers must hold at least one layer, got an empty chain")
    for i, layer in enumerate(chain):
        if not callable(layer):
            raise ValueError(f"layers[{i}] must be callable (a module or a function), got {type(layer).__name__}")
    return chain


def _check_input(x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"input must be one torch.Tensor, got {type(x).__name__}")
    return x


def run_chain(chain: Sequence[Layer], plan: RecomputePlan, x: torch.Tensor, stats: RecomputeStats) -> torch.Tensor:
    """Run ``chain`` on ``x`` the way ``plan`` says: plainly, segment by segment, or input-only."""
    if plan.kind == "none" or not torch.is_grad_enabled():
        return run_layers(chain, x, stats)
    if plan.kind == "recompute-all":
        segment = Segment(chain, 0, stats, chain_parameters(chain))
        return RecomputeAll.apply(segment, x, *segment.params)
    for start, stop in plan.segments:
        segment = Segment(chain[start:stop], start, stats, chain_parameters(chain[start:stop]))
        x = Checkpoint.apply(segment, x, *segment.params)
    return x


class Recompute(nn.Module):
    """Run ``layers`` in order, trading compute for activation memory as ``recompute`` says.

    ``recompute``: ``None`` stores every intermediate; ``k`` checkpoints every k layers (held ≈
    n/k + k, one extra forward); ``"sqrt"`` picks k ≈ √n; ``"full"`` is k = n (keep the input only,
    GPipe's re-materialisation); ``"recompute-all"`` keeps the input and re-runs from it for each
    layer (O(1) memory, O(n²) compute). Gradients are bitwise those of plain autograd: the re-run
    sees the same input, parameters, RNG state and autocast mode. ``stats`` counts layer forwards
    and re-runs as they happen.
    """

    def __init__(self, layers: nn.Sequential | nn.ModuleList | Sequence[Layer], recompute: Strategy = "none") -> None:
        super().__init__()
        chain = _as_chain(layers)
        self.layers = nn.ModuleList([layer for layer in chain if isinstance(layer, nn.Module)])
        self._chain = chain
        self.plan = plan_recompute(len(chain), recompute)
        self.stats = RecomputeStats()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_chain(self._chain, self.plan, _check_input(x), self.stats)

    def extra_repr(self) -> str:
        return f"recompute={self.plan.label}, n={self.plan.n}"


def recompute_sequential(layers: nn.Sequential | Sequence[Layer], x: torch.Tensor, recompute: Strategy = "sqrt",
                         stats: RecomputeStats | None = None) -> torch.Tensor:
    """Functional form of ``Recompute`` (like ``torch.utils.checkpoint.checkpoint_sequential``)."""
    chain = _as_chain(layers)
    return run_chain(chain, plan_recompute(len(chain), recompute), _check_input(x), stats or RecomputeStats())


def recompute_stage(stage: nn.Module, recompute: Strategy) -> nn.Module:
    """A pipeline stage with the per-stage option applied: unchanged for ``"none"`` (or None).

    An ``nn.Sequential`` stage is split into its children; any other module counts as one layer,
    so only ``"none"``, 1, ``"full"`` and ``"recompute-all"`` make sense for it.
    """
    if recompute is None or recompute == "none":
        return stage
    return Recompute(stage if isinstance(stage, nn.Sequential) else [stage], recompute)
