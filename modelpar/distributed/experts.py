"""Expert-parallel groups, folded into the data-parallel dimension (as Megatron-core does).

The d replicas of a (pp, tp) position are cut into d/ep blocks of ep consecutive replicas:
``dp_index = edp_index * ep + ep_index``. An *expert-parallel* group (fixed pp, tp, edp index)
holds ep replicas that each keep E/ep of the experts and exchange tokens by all-to-all; an
*expert-data-parallel* group (fixed pp, tp, ep index) holds the d/ep replicas that keep the same
experts, over which those experts' gradients are summed. Dense parameters stay reduced over all d.
Example pp = 1, dp = 4, tp = 1, ep = 2: ep groups [[0, 1], [2, 3]], edp groups [[0, 2], [1, 3]].
"""

from __future__ import annotations

from modelpar._validate import check_divisible, check_int
from modelpar.distributed.mesh import rank_groups

__all__ = ["expert_rank_groups"]


def expert_rank_groups(pp: int, dp: int, tp: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel groups, expert-data-parallel groups) of the (pp, dp, tp) grid, every rank in one of each."""
    check_int("ep", ep, minimum=1)
    check_divisible("dp", dp, "ep", ep)
    ep_groups, edp_groups = [], []
    for replicas in rank_groups(pp, dp, tp)["dp"]:  # the d ranks of one (pp, tp) position, in dp order
        ep_groups += [replicas[i:i + ep] for i in range(0, dp, ep)]
        edp_groups += [replicas[i::ep] for i in range(ep)]
    return sorted(ep_groups), sorted(edp_groups)
