"""GPipe's held activations measured on real tensors (reference §4.3): one process, one meter per stage.

``measure_gpipe`` runs GPipe's schedule through the pipeline runtime in one process (every stage on
one device, in the simulator's order; each stage's graph cut at its input as between devices), to
check ``modelpar.recompute.gpipe_activation_memory`` against what autograd really holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from modelpar._validate import check_divisible, check_int
from modelpar.pipeline.runner import PipelineRunner
from modelpar.recompute.meter import ActivationMeter, HeldActivations
from modelpar.schedules import gpipe, on_one_rank

__all__ = ["GPipeReport", "measure_gpipe"]


@dataclass(frozen=True)
class GPipeReport:
    """Per-stage peak held activations of one GPipe step, and the parameter gradients."""

    peaks: list[HeldActivations]
    grads: list[torch.Tensor]

    def sample_layers(self, width: int, itemsize: int = 8) -> list[float]:
        """Each stage's peak in samples × layers: bytes / (width × itemsize)."""
        return [peak.bytes / (width * itemsize) for peak in self.peaks]


class _OwnStorage(nn.Module):
    """Copies its input: each micro-batch gets its own storage, as if loaded on its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


def measure_gpipe(stages: Sequence[nn.Module], batch: torch.Tensor, microbatches: int) -> GPipeReport:
    """One GPipe step in one process, through ``PipelineRunner`` (group None), one meter per stage.

    A stage's input is the previous stage's output detached (what a device receives), so each
    stage owns its graph and its meter — entered around every action of that stage, forward and
    backward — sees only its own activations, re-runs included. The loss is the mean over rows
    of the last stage's outputs summed; the first stage's input needs no grad.
    """
    microbatches = check_int("microbatches", microbatches, minimum=1)
    check_divisible("batch rows", batch.shape[0], "microbatches", microbatches)
    schedule = on_one_rank(gpipe(ranks=len(stages), microbatches=microbatches))
    modules = {s: nn.Sequential(_OwnStorage(), stage) if s == 0 else stage for s, stage in enumerate(stages)}
    runner = PipelineRunner(schedule, modules, _row_mean_of_sums, None)
    meters = [ActivationMeter() for _ in stages]
    runner.register_action_hook(lambda action, _: meters[action.stage])
    runner.step(batch, torch.zeros(batch.shape[0]))
    params = [p for stage in stages for p in stage.parameters()]
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    return GPipeReport([meter.peak for meter in meters], grads)


def _row_mean_of_sums(out: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    return out.sum() / out.shape[0]
