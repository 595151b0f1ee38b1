"""Which layers a recomputation strategy keeps, and what that costs: pure Python, no torch.

The memory models here count *activations*: one per layer per sample, as in the reference's
tanh chain (reference §4.3, Chen et al. 2016 §4.3) and in GPipe's estimate (Huang et al. 2019
§2.3). The tests check that the torch implementation measures exactly these numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from modelpar._validate import check_divisible, check_int

__all__ = [
    "RECOMPUTE_NAMES",
    "ChainCost",
    "RecomputePlan",
    "Strategy",
    "best_k",
    "chain_cost",
    "gpipe_activation_memory",
    "parse_strategy",
    "plan_recompute",
]

# The one recomputation vocabulary (the library, `modelpar train --recompute` and the cost model):
#   "none"           no recomputation: store every activation (the one spelling; None is read as it)
#   "selective"      re-run only the attention core, QKᵀ · softmax · dropout · V (Korthikanti et al. 2022 §5):
#                    a property of attention layers, not of a chain
#   k (an int)       keep the input of every k-layer segment, re-run each segment once
#   "sqrt"           k ≈ √n
#   "full"           k = n: keep a stage's input only (GPipe's re-materialisation, Megatron's "full")
#   "recompute-all"  keep the input only, re-run from it for every layer (O(1) memory, O(n²) compute)
RECOMPUTE_NAMES = ("none", "selective", "full", "sqrt", "recompute-all")

Strategy = None | int | str
"""A ``recompute=`` value: a layer count k or one of ``RECOMPUTE_NAMES`` (``"none"``: no recomputation;
None is read as ``"none"``)."""


def parse_strategy(text: str) -> Strategy:
    """A command-line value: ``"4"`` -> 4, a name -> itself (lower case); anything else is a ValueError."""
    value = str(text).strip().lower()
    if value.isdigit():
        return int(value)
    if value not in RECOMPUTE_NAMES:
        raise ValueError(f"recompute must be one of {{{', '.join(RECOMPUTE_NAMES)}}} or a positive integer k, "
                         f"got {text!r}")
    return value


@dataclass(frozen=True)
class RecomputePlan:
    """A chain of ``n`` layers cut into checkpointed segments of ``k`` layers (the last may be shorter).

    ``kind`` is ``"none"`` (no recomputation, no segments: autograd keeps every intermediate), ``"every-k"``
    (each segment keeps only its input and is re-run once in backward) or ``"recompute-all"``
    (keep only the chain's input; re-run from it for every layer in backward).
    """

    kind: str
    n: int
    k: int

    @property
    def segments(self) -> list[tuple[int, int]]:
        """``(start, stop)`` of each checkpointed segment; empty for "none"."""
        if self.kind == "none":
            return []
        return [(a, min(a + self.k, self.n)) for a in range(0, self.n, self.k)]

    @property
    def label(self) -> str:
        """A short name for tables: ``none``, ``every-8``, ``full`` (k = n) or ``recompute-all``."""
        if self.kind == "every-k":
            return "full" if self.k == self.n else f"every-{self.k}"
        return self.kind


def _every_k_held(n: int, k: int) -> int:
    """Peak of checkpointing every k layers: backward visits segments last to first and frees each
    input after use, so while segment j is re-run it holds inputs 0..j plus its own activations."""
    return max(j + 1 + min(k, n - start) for j, start in enumerate(range(0, n, k)))


def best_k(n: int) -> int:
    """The segment length k that holds the fewest activations (≈ n/k + k): √n, or the nearest tie."""
    n = check_int("n", n, minimum=1)
    return min(range(1, n + 1), key=lambda k: (_every_k_held(n, k), abs(k - math.sqrt(n)), -k))


def plan_recompute(n: int, recompute: Strategy) -> RecomputePlan:
    """Resolve a ``recompute=`` option for a chain of ``n`` layers.

    ``None`` or ``"none"``: store every intermediate. ``k`` (1..n): checkpoint every k layers.
    ``"sqrt"``: k = ``best_k(n)`` ≈ √n. ``"full"``: k = n, keep only the chain's (stage's) input and
    re-run it once in backward (GPipe's re-materialisation, Megatron's "full").
    ``"recompute-all"``: keep only the input and re-run from it for every layer: O(1) memory, O(n²)
    compute. ``"selective"`` lives inside attention layers, so a chain refuses it.
    """
    n = check_int("number of layers", n, minimum=1)
    if recompute is None or recompute == "none":
        return RecomputePlan("none", n, n)
    if recompute == "selective":
        raise ValueError("recompute='selective' re-runs the attention core inside attention layers "
                         "(ParallelAttention(recompute_core=True), or a model built with recompute='selective'); "
                         "a chain of layers takes none, k, 'sqrt', 'full' or 'recompute-all'")
    if recompute == "recompute-all":
        return RecomputePlan("recompute-all", n, n)
    if recompute in ("full", "sqrt"):
        return RecomputePlan("every-k", n, n if recompute == "full" else best_k(n))
    if isinstance(recompute, bool) or not isinstance(recompute, int):
        allowed = ", ".join(repr(name) for name in RECOMPUTE_NAMES if name != "selective")
        raise ValueError(f"recompute must be None, an int k from 1 to {n}, or one of {allowed}; got {recompute!r}")
    return RecomputePlan("every-k", n, check_int(f"recompute (k, layers per segment of a {n}-layer chain)", recompute, 1, n))


@dataclass(frozen=True)
class ChainCost:
    """What a strategy costs on a chain whose layers each save one activation for backward."""

    held: int  # activations held at the peak of forward + backward
    extra_forwards: int  # layer forwards re-run during backward
    intermediates: int  # re-run outputs the forward had not kept (n − n/k for every-k)


def chain_cost(n: int, recompute: Strategy) -> ChainCost:
    """Closed-form held activations and extra forwards (Chen et al. 2016 §4.3, reference §4.3).

    none: n held, nothing re-run. every-k: the ceil(n/k) segment inputs plus one segment's k
    activations while it is re-run, exactly n/k + k when k divides n (minimum 2√n at k = √n; a
    shorter last segment can tie it); each layer is re-run once: n extra forwards, "about one
    more forward". recompute-all: the input plus one re-run activation, 2 held (O(1)),
    and layer l is reached by re-running layers 0..l: n(n + 1)/2 extra forwards (O(n²)).
    """
    plan = plan_recompute(n, recompute)
    if plan.kind == "none":
        return ChainCost(held=n, extra_forwards=0, intermediates=0)
    if plan.kind == "recompute-all":
        return ChainCost(held=2, extra_forwards=n * (n + 1) // 2, intermediates=n * (n + 1) // 2 - 1)
    segments = -(-n // plan.k)
    return ChainCost(held=_every_k_held(n, plan.k), extra_forwards=n, intermediates=n - segments)


def gpipe_activation_memory(batch: int, layers: int, stages: int, microbatches: int, recompute: bool) -> int:
    """Peak activations one GPipe device holds, in samples × layers (GPipe §2.3, reference §4.3).

    Without recomputation a device keeps all M micro-batches' activations for its L/K layers:
    N × L/K. With it, only each micro-batch's stage input (N samples in all) plus, while one
    micro-batch is re-run, its L/K layers: N + L/K × N/M. N = 256, L = 48, K = 4, M = 32 gives
    3072 / 352 = 8.7× less; at M = 1 recomputation holds N more than it saves.
    """
    batch = check_int("batch", batch, minimum=1)
    layers = check_int("layers", layers, minimum=1)
    stages = check_int("stages", stages, minimum=1)
    microbatches = check_int("microbatches", microbatches, minimum=1)
    check_divisible("layers", layers, "stages", stages)
    check_divisible("batch", batch, "microbatches", microbatches)
    per_stage = layers // stages
    if not recompute:
        return batch * per_stage
    return batch + per_stage * (batch // microbatches)
