"""Split one stage's backward into I (input gradient, now) and W (weight gradients, later).

Zero-bubble pipelines (Qi et al. 2024, §2) run I on the critical path and defer W. ``I``
back-propagates from the stage output to its input only; autograd then skips every matrix
product that only weights need. Nodes on that input path which also feed weights record the
gradient flowing into them (a node pre-hook), so ``W`` can restart from exactly those nodes
(``GradientEdge`` roots) and compute the weight products once — no part of the backward runs
twice. The same trick as ``torch.distributed.pipelining``'s ``stage_backward_input/weight``::

    out ─► AddmmBackward ─► GeluBackward ─► AddmmBackward ─► x_in        (I: this path)
                 │                               │
                 └─► TBackward ─► W2              └─► TBackward ─► W1     (W: from the recorded
                                                                           grads, per node)

A leaf reached from two different nodes (a tied weight) would be counted twice that way, so
W computes its gradient from the stage output instead (correct, just not split).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.autograd.graph import GradientEdge, Node

from modelpar._compat import grad_accumulator_variable

__all__ = ["backward_input"]


def backward_input(
    out: torch.Tensor, grad: torch.Tensor | None, x_in: torch.Tensor | None
) -> tuple[torch.Tensor | None, Callable[[], None]]:
    """Compute d(out)/d(x_in)·grad now; return it and the closure that accumulates weight grads.

    ``grad`` None means ``out`` is a scalar loss. ``x_in`` None (a first stage, whose input
    needs no gradient) makes I empty and W the whole backward.
    """
    if out.grad_fn is None:  # nothing in this stage needs a gradient
        return (torch.zeros_like(x_in) if x_in is not None else None), lambda: None
    grads = [grad] if grad is not None else None
    on_path = _leads_to(out.grad_fn, x_in) if x_in is not None else {}
    if x_in is None or not on_path[out.grad_fn]:  # the output does not depend on the input: everything is W
        zero = torch.zeros_like(x_in) if x_in is not None else None
        return zero, lambda: torch.autograd.backward([out], grads)
    groups, shared = _weight_groups(on_path)
    captured: dict[Node, tuple] = {}
    handles = [n.register_prehook(_recorder(captured, n)) for n in groups]
    try:
        (gx,) = torch.autograd.grad([out], [x_in], grads, retain_graph=True)
    finally:
        for h in handles:
            h.remove()

    def weight() -> None:
        if shared:  # tied leaves: from the output, while the graph is still whole
            torch.autograd.backward([out], grads, inputs=shared, retain_graph=True)
        for node, leaves in groups.items():
            edges = [(GradientEdge(node, i), g) for i, g in enumerate(captured.get(node, ())) if g is not None]
            if edges:
                torch.autograd.backward(
                    [e for e, _ in edges], [g for _, g in edges], inputs=leaves, retain_graph=True
                )

    return gx, weight


def _recorder(captured: dict[Node, tuple], node: Node) -> Callable[[tuple], None]:
    def hook(grad_outputs: tuple) -> None:
        captured[node] = tuple(grad_outputs)

    return hook


def _children(node: Node) -> list[Node]:
    return [c for c, _ in node.next_functions if c is not None]


def _under(root: Node) -> Iterator[Node]:
    """Every node under ``root`` (``root`` included), each once."""
    seen, stack = {root}, [root]
    while stack:
        n = stack.pop()
        yield n
        for c in _children(n):
            if c not in seen:
                seen.add(c)
                stack.append(c)


def _leads_to(root: Node, leaf: torch.Tensor) -> dict[Node, bool]:
    """For every node under ``root``: does a path lead from it to ``leaf``'s AccumulateGrad? (post-order)"""
    memo: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        n, expanded = stack.pop()
        if n in memo:
            continue
        if expanded:
            memo[n] = grad_accumulator_variable(n) is leaf or any(memo[c] for c in _children(n))
        else:
            stack.append((n, True))
            stack.extend((c, False) for c in _children(n) if c not in memo)
    return memo


def _weight_groups(on_path: dict[Node, bool]) -> tuple[dict[Node, list[torch.Tensor]], list[torch.Tensor]]:
    """Nodes on the input path that also feed leaves, with those leaves; and the shared leaves."""
    groups: dict[Node, list[torch.Tensor]] = {}
    owner: dict[int, Node] = {}
    shared: dict[int, torch.Tensor] = {}
    for node, leads in on_path.items():
        if not leads:
            continue
        for child in _children(node):
            if on_path[child]:
                continue
            for leaf in _leaves(child):
                first = owner.setdefault(id(leaf), node)
                if first is not node:
                    shared[id(leaf)] = leaf
                groups.setdefault(node, [])
                if all(leaf is not x for x in groups[node]):
                    groups[node].append(leaf)
    for node in list(groups):
        groups[node] = [x for x in groups[node] if id(x) not in shared]
        if not groups[node]:
            del groups[node]
    return groups, list(shared.values())


def _leaves(node: Node) -> list[torch.Tensor]:
    """The leaf tensors (parameters) whose AccumulateGrad nodes lie under ``node``."""
    return [v for n in _under(node) if (v := grad_accumulator_variable(n)) is not None]
