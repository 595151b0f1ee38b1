"""Mixture-of-experts figures (pure Python): parameters, total and active, and the all-to-all volume.

An MoE layer (docs/moe.md) holds a router (h·E), E routed SwiGLU experts of width F and S shared
ones (3·h·F each); a token uses the router and k + S experts. Under expert parallelism over ep
ranks each rank holds E/ep experts and, per MoE layer and micro-batch, sends its tokens' k
assignments (rows of h elements) to the experts' ranks and receives the results back: two
all-to-alls forward (dispatch, combine) and two backward. With routing uniform over the experts a
share (ep − 1)/ep of the rows leaves the rank (the rest stays local, no bytes).

Step time and activations (``moe_gemms``, ``all_to_alls``, ``moe_activation_bytes``): the terms the
cost models (``local.py`` for the trainer, ``estimate.py`` for published runs) put in place of a
dense MLP's. With uniform routing a rank's b·s tokens make a = b·s·k·min(1, CF) assignments
(dropless: CF = ∞; with CF ≥ 1 uniform routing drops nothing), each of the E/ep local experts gets
ep·a/E rows from its ep group; the router's [b·s, h]·[h, E] GEMM and the shared experts' SwiGLU run
on every token. Autograd keeps (counted from ``modelpar.model.moe`` with saved-tensor hooks, exact
at uniform routing): per token the router's fp32 (fp64) scores E, the top-k values k, their sum 1
(sigmoid: the scores' sum too), the top-k indices (int64) and the keep mask (bool); per assignment
the gated output and the combined rows 2h, the gate 1 and two int64 index rows; per expert row its
input h, gate|up 2F, SiLU F and the product F; the shared SwiGLU 4·S·F/t; per sequence [E] of the
balance loss. The router's input is the norm output the dense MLP keeps too (counted there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from modelpar._validate import check_divisible, check_int, check_number

__all__ = [
    "ALL_TO_ALLS_PER_LAYER",
    "MOE_OPS",
    "MOE_OPS_PER_EXPERT",
    "MoESeconds",
    "MoESpec",
    "active_moe_layer_params",
    "all_to_all_bytes",
    "all_to_alls",
    "check_trainer_experts",
    "moe_activation_bytes",
    "moe_gemms",
    "moe_layer_params",
    "moe_layer_seconds",
    "moe_layer_tensors",
    "moe_layers",
    "moe_spans",
]

ALL_TO_ALLS_PER_LAYER = 4  # per MoE layer and micro-batch: dispatch and combine, forward and backward


@dataclass(frozen=True)
class MoESpec:
    """The mixture of experts of a model in plain numbers: E routed experts of width F, S shared ones, every N-th layer."""

    experts: int
    ffn: int
    shared: int = 0
    every: int = 1
    top_k: int = 2
    capacity_factor: float | None = None  # None: dropless
    router: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    first_dense: int = 0  # the first layers stay dense (DeepSeek-V3: 3); the planner's, the trainer has none

    def __post_init__(self) -> None:
        check_int("experts", self.experts, minimum=1)
        check_int("top_k", self.top_k, minimum=1, maximum=self.experts)
        if self.capacity_factor is not None:
            check_number("capacity_factor", self.capacity_factor, strict=True)

    def layers(self, total: int) -> tuple[int, ...]:
        """Global indices of the MoE layers of a ``total``-layer model."""
        return moe_layers(total, self.every, self.first_dense)

    @property
    def kept(self) -> float:
        """Share of assignments kept under uniform routing: min(1, CF) (dropless: 1)."""
        return 1.0 if self.capacity_factor is None else min(1.0, self.capacity_factor)

    def assignments(self, tokens: float) -> float:
        """Expert rows ``tokens`` tokens make under uniform routing: tokens · k · ``kept``."""
        return tokens * self.top_k * self.kept


def moe_layers(layers: int, every: int, first_dense: int = 0) -> tuple[int, ...]:
    """Global indices of the MoE layers: i ≥ first_dense with (i + 1) % every == 0."""
    return tuple(i for i in range(first_dense, layers) if (i + 1) % every == 0)


def moe_layer_tensors(hidden: int, experts: int, ffn: int, shared: int = 0, t: int = 1,
                      ep: int = 1) -> list[tuple[str, int]]:
    """One MoE block's parameters on one rank, in module order, as (kind, elements): the router [E, h] and the
    routed experts' [E/ep, 2F, h] and [E/ep, h, F] (kinds "router", "expert"; replicated over t), the shared
    experts' SwiGLU of width S·F split over t as the dense MLP (kind "shared")."""
    out = [("router", hidden * experts), ("expert", experts // ep * 2 * ffn * hidden),
           ("expert", experts // ep * hidden * ffn)]
    if shared:
        out += [("shared", 2 * (shared * ffn) // t * hidden), ("shared", hidden * (shared * ffn) // t)]
    return out


def moe_layer_params(hidden: int, experts: int, ffn: int, shared: int = 0) -> int:
    """Parameters of one MoE block (router + routed + shared experts; norms and attention excluded)."""
    return sum(n for _, n in moe_layer_tensors(hidden, experts, ffn, shared))


def active_moe_layer_params(hidden: int, experts: int, top_k: int, ffn: int, shared: int = 0) -> int:
    """Parameters one token uses in an MoE block: the router and k + S experts (the FLOPs are 2× this per token)."""
    check_int("top_k", top_k, minimum=1, maximum=experts)
    return hidden * experts + 3 * hidden * ffn * (top_k + shared)


def all_to_all_bytes(tokens: int, hidden: int, top_k: int, ep: int, bytes_per_element: int,
                     remote_share: float | None = None) -> float:
    """Bytes one rank sends in one all-to-all of one MoE layer for ``tokens`` tokens.

    ``remote_share``: the share of the tokens' k assignments bound for other ranks; None: uniform
    routing, (ep − 1)/ep. Dropped assignments send nothing: pass the measured share for those.
    """
    check_int("ep", ep, minimum=1)
    share = (ep - 1) / ep if remote_share is None else check_number("remote_share", remote_share)
    return tokens * top_k * share * hidden * bytes_per_element


def check_trainer_experts(experts: int, ep: int, dp: int, cp: int = 1, sequence_parallel: bool = False) -> None:
    """ValueError (one line) unless ``modelpar train`` runs this mixture-of-experts layout (docs/moe.md).

    The one rule the trainer (``TrainConfig.check``) and the planner share: ep folds into d (ep divides
    d and E) and combines with every ZeRO stage, p and t (the routed experts whole on every tensor-parallel
    rank: expert tensor parallelism 1, as Megatron's ``--expert-tensor-parallel-size 1``); experts refuse
    cp > 1 (routing, capacity and balance are per whole sequence) and sequence parallelism.
    """
    check_int("ep", ep, minimum=1)
    if experts and cp > 1:
        raise ValueError(f"experts with cp > 1 is not supported (a MoE layer routes and balances whole "
                         f"sequences); use cp 1, got cp {cp}")
    if experts and sequence_parallel:
        raise ValueError("experts with sequence_parallel is not supported (the routed experts are "
                         "replicated over t); use sequence_parallel false")
    if ep == 1:
        return
    if not experts:
        raise ValueError(f"ep ({ep}) needs a mixture of experts (experts > 0), got experts 0")
    check_divisible("dp", dp, "ep", ep)  # the expert-parallel group is carved out of the d replicas
    check_divisible("experts", experts, "ep", ep)


def moe_gemms(spec: MoESpec, tokens: int, hidden: int, t: int = 1, ep: int = 1) -> list[tuple[int, tuple[int, int, int]]]:
    """(count, (m, n, k)) of one MoE block's forward GEMMs x[m×k]·w[k×n] on one rank, in place of the MLP's:
    the router (replicated over t), each of the E/ep local experts' gate|up and down on its ep·a/E rows
    (uniform routing), the shared experts' SwiGLU split over t."""
    e, f, h = spec.experts, spec.ffn, hidden
    rows = max(1, round(ep * spec.assignments(tokens) / e))
    out = [(1, (tokens, e, h)), (e // ep, (rows, 2 * f, h)), (e // ep, (rows, h, f))]
    if spec.shared:
        out += [(1, (tokens, 2 * spec.shared * f // t, h)), (1, (tokens, h, spec.shared * f // t))]
    return out


def all_to_alls(spec: MoESpec, tokens: int, hidden: int, ep: int, bytes_per_element: int) -> list[tuple[str, float]]:
    """(phase, bytes one rank sends) of each all-to-all one MoE block issues per micro-batch: dispatch and
    combine forward, their two gradients backward (``ALL_TO_ALLS_PER_LAYER``); none when ep = 1."""
    if ep == 1:
        return []
    sent = all_to_all_bytes(tokens, hidden, spec.top_k, ep, bytes_per_element, (ep - 1) / ep * spec.kept)
    return [("forward", sent)] * 2 + [("backward", sent)] * 2


def moe_activation_bytes(spec: MoESpec, tokens: int, sequences: int, hidden: int, t: int,
                         bytes_per_element: int) -> float:
    """Bytes autograd keeps for one MoE block and micro-batch on one rank beyond its input (module docstring):
    router scores and top-k, the dispatched and combined rows, the experts' intermediates, the shared SwiGLU."""
    e, k, f, h = spec.experts, spec.top_k, spec.ffn, hidden
    score = max(4, bytes_per_element)  # the router's scores are fp32 under bf16
    rows = spec.assignments(tokens)
    per_token = (e + k + (2 if spec.router == "sigmoid" else 1)) * score + 9 * k + 4 * spec.shared * f / t * bytes_per_element
    per_row = (2 * h + 1) * bytes_per_element + 16 + (h + 4 * f) * bytes_per_element
    return tokens * per_token + rows * per_row + sequences * e * score


MOE_OPS = 45  # ops a MoE block dispatches beyond the MLP's (routing, sorting, counts, combine), counted from the code
MOE_OPS_PER_EXPERT = 8  # per local expert: gather its rows, gate|up, chunk, SiLU, product, down, split


@dataclass(frozen=True)
class MoESeconds:
    """Seconds one MoE block adds over the dense MLP it replaces, one micro-batch on one rank."""

    forward: float  # GEMMs and dispatched ops, all-to-alls excluded
    dgrad: float  # input-gradient GEMMs and the backward's ops
    wgrad: float  # weight-gradient GEMMs
    a2a_forward: float  # dispatch and combine
    a2a_backward: float  # their gradients


def moe_layer_seconds(spec: MoESpec, tokens: int, hidden: int, t: int, ep: int, bytes_per_element: int,
                      mlp: list[tuple[int, int, int]], matmul: Callable[[int, int, int], float],
                      all_to_all: Callable[[float], float], op_latency: float) -> MoESeconds:
    """Price one MoE block against the MLP (``mlp``: its forward GEMM shapes) it replaces: ``moe_gemms`` at
    ``matmul(m, n, k)`` seconds (forward x·w, input gradient [m×n]·[n×k], weight gradient [k×m]·[m×n]), the
    ``all_to_alls`` at ``all_to_all(bytes sent)``, ``MOE_OPS`` + ``MOE_OPS_PER_EXPERT``·E/ep more ops (twice
    in the backward) at ``op_latency``."""
    fwd = dgrad = wgrad = 0.0
    for count, (m, n, k) in moe_gemms(spec, tokens, hidden, t, ep):
        fwd, dgrad, wgrad = fwd + count * matmul(m, n, k), dgrad + count * matmul(m, k, n), wgrad + count * matmul(k, n, m)
    for m, n, k in mlp:
        fwd, dgrad, wgrad = fwd - matmul(m, n, k), dgrad - matmul(m, k, n), wgrad - matmul(k, n, m)
    ops = (MOE_OPS + MOE_OPS_PER_EXPERT * spec.experts // ep) * op_latency
    comm = {"forward": 0.0, "backward": 0.0}
    for phase, sent in all_to_alls(spec, tokens, hidden, ep, bytes_per_element):
        comm[phase] += all_to_all(sent)
    return MoESeconds(fwd + ops, dgrad + 2 * ops, wgrad, comm["forward"], comm["backward"])


def moe_spans(start: float, end: float, moe_flags: list[bool], sec: MoESeconds, kind: str,
              recomputed: bool = False) -> list[tuple[float, float]]:
    """Where a stage's expert all-to-alls fall inside one of its actions (``kind`` "F", or "B"/"I": the backward
    through the input), as (start, end): for drawing, the lengths the cost model priced. The action's other time
    is spread evenly over the stage's layers (``moe_flags``: which are MoE, in forward order); in a MoE layer
    the forward runs attention and router, dispatch, experts, combine (halves of its compute, halves of
    ``a2a_forward``), the backward the reverse, after the recomputed forward's two when ``recomputed``."""
    f, b = sec.a2a_forward / 2, sec.a2a_backward / 2
    if kind == "F":
        pieces: list[tuple[str, float]] = [("c", 0.5), ("a", f), ("c", 0.5), ("a", f)]
    else:
        again = [("c", 0.25), ("a", f), ("c", 0.25), ("a", f)] if recomputed else []
        pieces = again + [("a", b), ("c", 0.5 if not recomputed else 0.25), ("a", b), ("c", 0.5 if not recomputed else 0.25)]
    comm = sum(x for k, x in pieces if k == "a") * sum(moe_flags)
    compute = max(0.0, end - start - comm) / max(1, len(moe_flags))
    spans, t = [], start
    for is_moe in (moe_flags if kind == "F" else moe_flags[::-1]):
        for k, x in (pieces if is_moe else [("c", 1.0)]):
            if k == "a":
                spans.append((t, t + x))
            t += x if k == "a" else x * compute
    return spans
