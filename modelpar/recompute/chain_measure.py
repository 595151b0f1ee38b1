"""Measure a strategy: activations held at peak, layer forwards re-run, and the gradients.

``measure_chain`` runs one forward + backward of a ``Recompute`` chain under an
``ActivationMeter``; ``strategy_table`` compares the strategies. GPipe's memory model measured
through the pipeline runtime is ``modelpar.bench.measure_gpipe`` (it needs the runtime, a layer up).
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
from modelpar.recompute.meter import ActivationMeter
from modelpar.recompute.module import Recompute
from modelpar.recompute.strategies import Strategy, chain_cost

__all__ = ["ChainReport", "ScaledTanh", "measure_chain", "scaled_tanh_stages", "strategy_table"]


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
    activation each, if ``model``), bytes, extra forwards, gradients bitwise equal to those without recomputation,
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
