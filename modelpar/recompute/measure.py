"""Measure a strategy: activations held at peak, layer forwards re-run, and the gradients.

``measure_chain`` runs one forward + backward of a ``Recompute`` chain under an
``ActivationMeter``. ``measure_gpipe`` runs GPipe's schedule through the pipeline runtime in one
process (every stage on one device, in the simulator's order; each stage's graph cut at its
input as between devices) with one meter per stage, to check GPipe's memory model (reference
§4.3) on real tensors.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from modelpar._validate import check_divisible, check_int
from modelpar.recompute.functions import chain_parameters
from modelpar.recompute.meter import ActivationMeter, HeldActivations
from modelpar.recompute.module import Recompute
from modelpar.recompute.plan import Strategy, chain_cost

__all__ = ["ChainReport", "GPipeReport", "ScaledTanh", "measure_chain", "measure_gpipe", "scaled_tanh_stages", "strategy_table"]


class ScaledTanh(nn.Module):
    """``w ⊙ tanh(x)``: a layer with parameters that saves exactly one activation (tanh's output)."""

    def __init__(self, width: int, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width, dtype=dtype).uniform_(0.5, 1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * torch.tanh(x)


@dataclass(frozen=True)
class ChainReport:
    """One strategy on one chain: measured held activations, layer forwards, re-runs."""

    label: str
    held: int  # activations saved for backward at the peak (distinct storages)
    held_bytes: int
    forwards: int  # layer forwards in the forward pass
    extra_forwards: int  # layer forwards re-run during backward
    intermediates: int  # re-run outputs the forward had not kept


def measure_chain(layers: Sequence[Callable[[torch.Tensor], torch.Tensor]] | nn.Sequential, x: torch.Tensor,
                  recompute: Strategy, loss: Callable[[torch.Tensor], torch.Tensor] = torch.sum,
                  ) -> tuple[ChainReport, list[torch.Tensor | None]]:
    """Forward + backward of ``Recompute(layers, recompute)`` on ``x``; the gradients of ``loss``.

    Gradients are returned for ``x`` (when it needs grad) then every parameter needing grad, in
    order; ``.grad`` fields are left untouched.
    """
    chain = Recompute(layers, recompute)
    inputs = ([x] if x.requires_grad else []) + chain_parameters(list(chain._chain))
    meter = ActivationMeter()
    with meter:
        out = loss(chain(x))
        grads: list[torch.Tensor | None] = list(torch.autograd.grad(out, inputs, allow_unused=True)) if inputs else []
    report = ChainReport(chain.plan.label, meter.peak_count, meter.peak_bytes, chain.stats.forwards, chain.stats.recomputed,
                         chain.stats.intermediates)
    return report, grads


def strategy_table(layers: Sequence[Callable[[torch.Tensor], torch.Tensor]] | nn.Sequential, x: torch.Tensor,
                   strategies: Sequence[Strategy], repeats: int = 0, model: bool = True) -> str:
    """One row per strategy: measured held activations (and ``chain_cost``'s, for layers saving one
    activation each, if ``model``), bytes, extra forwards, gradients bitwise equal to store-all's,
    and the median forward + backward time over ``repeats`` steps (none if 0)."""
    _, plain = measure_chain(layers, x, None)
    head = f"{'strategy':14} {'held':>5} {'model':>6} {'held KiB':>10} {'extra forwards':>15} {'re-created':>10}  bitwise equal"
    head = head if model else head.replace(f" {'model':>6}", "")
    rows = [head + ("  fwd+bwd ms" if repeats else "")]
    for recompute in strategies:
        report, grads = measure_chain(layers, x, recompute)
        equal = len(grads) == len(plain) and all(_same(a, b) for a, b in zip(grads, plain))
        expected = f" {chain_cost(len(layers), recompute).held:6}" if model else ""
        row = (f"{report.label:14} {report.held:5}{expected} "
               f"{report.held_bytes / 1024:10.0f} {report.extra_forwards:15} {report.intermediates:10}  {equal!s:13}")
        if repeats:
            chain = Recompute(layers, recompute)
            seconds = []
            for _ in range(repeats):
                start = time.perf_counter()
                chain(x).sum().backward()
                seconds.append(time.perf_counter() - start)
            row += f"  {statistics.median(seconds) * 1e3:10.2f}"
        rows.append(row.rstrip())
    return "\n".join(rows)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bitwise equal tensors, or both None (an unused input)."""
    return a is b is None or (a is not None and b is not None and torch.equal(a, b))


def scaled_tanh_stages(layers: int, stages: int, width: int, recompute: Strategy, seed: int = 0) -> list[Recompute]:
    """``stages`` stages of ``layers / stages`` ScaledTanh layers each, the same for any ``recompute``."""
    check_divisible("layers", check_int("layers", layers, 1), "stages", check_int("stages", stages, 1))
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    chains = [[ScaledTanh(width) for _ in range(layers // stages)] for _ in range(stages)]
    torch.random.set_rng_state(generator_state)
    return [Recompute(chain, recompute) for chain in chains]


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
    from modelpar.pipeline.runner import PipelineRunner
    from modelpar.schedules import gpipe, on_one_device

    microbatches = check_int("microbatches", microbatches, minimum=1)
    check_divisible("batch rows", batch.shape[0], "microbatches", microbatches)
    schedule = on_one_device(gpipe(stages=len(stages), microbatches=microbatches))
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
