"""Mixture-of-experts figures (pure Python): parameters, total and active, and the all-to-all volume.

An MoE layer (docs/moe.md) holds a router (h·E), E routed SwiGLU experts of width F and S shared
ones (3·h·F each); a token uses the router and k + S experts. Under expert parallelism over ep
ranks each rank holds E/ep experts and, per MoE layer and micro-batch, sends its tokens' k
assignments (rows of h elements) to the experts' ranks and receives the results back: two
all-to-alls forward (dispatch, combine) and two backward. With routing uniform over the experts a
share (ep − 1)/ep of the rows leaves the rank (the rest stays local, no bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from modelpar._validate import check_divisible, check_int, check_number

__all__ = ["ALL_TO_ALLS_PER_LAYER", "MoESpec", "active_moe_layer_params", "all_to_all_bytes",
           "check_trainer_experts", "moe_layer_params", "moe_layer_tensors", "moe_layers"]

ALL_TO_ALLS_PER_LAYER = 4  # per MoE layer and micro-batch: dispatch and combine, forward and backward


@dataclass(frozen=True)
class MoESpec:
    """The mixture of experts of a model in plain numbers: E routed experts of width F, S shared ones, every N-th layer."""

    experts: int
    ffn: int
    shared: int = 0
    every: int = 1


def moe_layers(layers: int, every: int) -> tuple[int, ...]:
    """Global indices of the MoE layers: i with (i + 1) % every == 0."""
    return tuple(i for i in range(layers) if (i + 1) % every == 0)


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
