"""The two autograd Functions behind the strategies: re-run a segment once, or once per layer.

``Checkpoint`` (every-k, "full"; Chen et al. 2016 §4.3, GPipe §2.3)::

    forward:   h0 ──no_grad──► h1 ──► ... ──► hk        keep h0 only
    backward:  h0 ──enable_grad──► h1 ... hk (graph)    re-run once, back-propagate, drop

``RecomputeAll`` (the O(1)-memory, O(n²)-compute extreme)::

    backward, l = n-1 .. 0:   h0 ──no_grad──► h_l ──enable_grad──► h_{l+1}   (l + 1 forwards)
                              back-propagate through layer l only, then drop h_l

``recompute_function(fn, *inputs)`` does the same for one function of several tensors with no
parameters (the attention core of selective recomputation): keep the inputs, re-run ``fn``.

The first two take the parameters as Function inputs and return their gradients from
``torch.autograd.grad``, so they work when the chain's input needs no grad (a first pipeline stage)
and gradient hooks fire as in plain autograd. Plain-callable layers must not capture tensors that
need grad: only ``nn.Module`` parameters are given gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from modelpar._compat import tensor_version
from modelpar.recompute.rng import capture_state, replay

__all__ = ["Checkpoint", "RecomputeAll", "RecomputeStats", "Segment", "chain_parameters", "recompute_function",
           "run_layers"]

Layer = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class RecomputeStats:
    """Layer forwards counted as they run: in the forward pass, and re-run during backward.

    ``intermediates``: the re-run outputs that the forward had not kept. A segment's last re-run
    output is the next segment's stored input (or the chain's output), so every-k re-runs n layer
    forwards but re-creates only n − n/k activations — the reference's count (§9, exercise 6: 90
    for n = 100, k = 10). The last layer is re-run all the same: autograd needs its graph.
    """

    forwards: int = 0
    recomputed: int = 0
    intermediates: int = 0

    def reset(self) -> None:
        self.forwards = self.recomputed = self.intermediates = 0


def run_layers(layers: Sequence[Layer], x: torch.Tensor, stats: RecomputeStats, start: int = 0, *,
               recomputing: bool = False) -> torch.Tensor:
    """Apply ``layers`` in order, counting each call; a layer must return one tensor."""
    for i, layer in enumerate(layers):
        y = layer(x)
        if recomputing:
            stats.recomputed += 1
        else:
            stats.forwards += 1
        if not isinstance(y, torch.Tensor):
            raise ValueError(f"layers[{start + i}] ({_name(layer)}) returned {type(y).__name__}; "
                             "a recomputed chain needs every layer to return one torch.Tensor")
        x = y
    return x


def chain_parameters(layers: Sequence[Layer]) -> list[torch.Tensor]:
    """The parameters needing grad of the ``nn.Module`` layers, each once, in order."""
    seen: dict[int, torch.Tensor] = {}
    for layer in layers:
        if isinstance(layer, nn.Module):
            for p in layer.parameters():
                if p.requires_grad:
                    seen.setdefault(id(p), p)
    return list(seen.values())


@dataclass
class Segment:
    """A run of consecutive layers of a chain: ``layers[start : start + len(layers)]``."""

    layers: Sequence[Layer]
    start: int
    stats: RecomputeStats
    params: list[torch.Tensor] = field(default_factory=list)

    def run(self, x: torch.Tensor, stop: int | None = None, recomputing: bool = False) -> torch.Tensor:
        return run_layers(self.layers[:stop], x, self.stats, self.start, recomputing=recomputing)


@contextmanager
def _running_stats_kept(layers: Sequence[Layer]) -> Iterator[None]:
    """A re-run must not update BatchNorm's running statistics a second time: restore them after."""
    saved = [(b, b.clone()) for layer in layers if isinstance(layer, nn.Module) for m in layer.modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for b in m.buffers(recurse=False)]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def _grads(y: torch.Tensor, inputs: list[torch.Tensor | None], grad_y: torch.Tensor) -> list[torch.Tensor | None]:
    """d(y · grad_y)/d(input) for each input that is not None; None where not needed or unused."""
    wanted = [t for t in inputs if t is not None]
    if not wanted or not y.requires_grad:
        return [None] * len(inputs)
    found = iter(torch.autograd.grad(y, wanted, grad_y, allow_unused=True))
    return [next(found) if t is not None else None for t in inputs]


def _input_leaf(h: torch.Tensor, needs_grad: bool) -> torch.Tensor:
    return h.detach().requires_grad_(needs_grad)


class _KeepInput(torch.autograd.Function):
    """The forward both strategies share: run without building a graph, keep only the input."""

    @staticmethod
    def forward(ctx, segment: Segment, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.segment, ctx.state = segment, capture_state(x)  # parameters are inputs only to get gradients
        ctx.save_for_backward(x)
        version = tensor_version(x)
        y = segment.run(x)  # autograd.Function.forward runs with grad mode off
        if tensor_version(x) != version:  # the re-run would start from the modified input: wrong gradients
            raise ValueError(
                f"layers[{segment.start}] ({_name(segment.layers[0])}) modified its input in place; a "
                "recomputed segment must start from the input it saw (use inplace=False, e.g. nn.Dropout)"
            )
        return y.view_as(y) if y is x else y  # an identity chain must not return its input as-is


class Checkpoint(_KeepInput):
    """Keep a segment's input only; in backward re-run the segment once and back-propagate through it."""

    @staticmethod
    @once_differentiable  # a double backward gets a clear error, not a silently detached gradient
    def backward(ctx, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        segment: Segment = ctx.segment
        with _running_stats_kept(segment.layers):  # restored once the gradients are computed
            with replay(ctx.state), torch.enable_grad():
                x_leaf = _input_leaf(x, ctx.needs_input_grad[1])
                y = segment.run(x_leaf, recomputing=True)
            segment.stats.intermediates += len(segment.layers) - 1  # the last output was kept
            needs = ctx.needs_input_grad[1:]
            inputs = [t if need else None for t, need in zip([x_leaf, *segment.params], needs)]
            return (None, *_grads(y, inputs, grad_y))


class RecomputeAll(_KeepInput):
    """Keep the chain's input only; for each layer, last to first, re-run the chain up to it."""

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        segment: Segment = ctx.segment
        needs = dict(zip(map(id, segment.params), ctx.needs_input_grad[2:]))
        param_grads: dict[int, torch.Tensor] = {}
        with _running_stats_kept(segment.layers):  # every re-run updates BatchNorm stats: restore at the end
            grad: torch.Tensor | None = grad_y
            for l in reversed(range(len(segment.layers))):
                layer = segment.layers[l]
                params = [p for p in chain_parameters([layer]) if needs.get(id(p))]
                with replay(ctx.state):  # same generator as the forward: layers 0..l-1 redraw their masks
                    with torch.no_grad():
                        h = segment.run(x, stop=l, recomputing=True)  # h_l from h_0: l forwards
                    with torch.enable_grad():
                        h_leaf = _input_leaf(h, l > 0 or ctx.needs_input_grad[1])
                        y = run_layers([layer], h_leaf, segment.stats, segment.start + l, recomputing=True)
                last = l == len(segment.layers) - 1
                segment.stats.intermediates += l + (0 if last else 1)  # h_1..h_l, and h_(l+1) unless the output
                upstream = cast(torch.Tensor, grad)  # not None: the loop stops once nothing below needs one
                grad, *grads = _grads(y, [h_leaf if h_leaf.requires_grad else None, *params], upstream)
                for p, g in zip(params, grads):
                    if g is not None:
                        param_grads[id(p)] = g if id(p) not in param_grads else param_grads[id(p)] + g
                if grad is None:  # nothing below layer l needs a gradient
                    break
            return (None, grad if ctx.needs_input_grad[1] else None, *(param_grads.get(id(p)) for p in segment.params))


class _RecomputeFunction(torch.autograd.Function):
    """Keep the inputs of ``fn`` only; in backward re-run it (same RNG and autocast) and back-propagate."""

    @staticmethod
    def forward(ctx, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.state = fn, capture_state(inputs[0])
        ctx.save_for_backward(*inputs)
        return fn(*inputs)  # grad mode is off: nothing inside is kept

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        needs = ctx.needs_input_grad[1:]
        with replay(ctx.state), torch.enable_grad():
            leaves = [_input_leaf(x, need) for x, need in zip(ctx.saved_tensors, needs)]
            y = ctx.fn(*leaves)
        return (None, *_grads(y, [x if need else None for x, need in zip(leaves, needs)], grad_y))


def recompute_function(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """``fn(*inputs)`` keeping only ``inputs`` for backward, which re-runs ``fn`` (bitwise the same).

    ``fn`` must return one tensor and hold no parameters that need gradients.
    """
    return _RecomputeFunction.apply(fn, *inputs)


def _name(layer: Layer) -> str:
    return type(layer).__name__ if isinstance(layer, nn.Module) else getattr(layer, "__name__", type(layer).__name__)
