"""The layout axes both planners search (``costmodel.axes``): each axis's values and rule, hand-checked, and the
two planners reading the same rule (issue 38: a dimension's axis in one place)."""

from collections import Counter
from collections.abc import Sequence
from typing import Any

from modelpar.costmodel.axes import (
    PUBLISHED,
    Axis,
    Chosen,
    Outcome,
    Planner,
    batch_splits,
    context_splits,
    divisors,
    expert_splits,
    heads_split,
    sequence_parallel_choices,
    shards,
    walk,
)
from modelpar.costmodel.local_memory import LocalLayout
from modelpar.costmodel.local_search import Capabilities, layouts
from modelpar.costmodel.moe import MoESpec
from modelpar.costmodel.presets import make_cluster, model_preset
from modelpar.costmodel.search import search
from modelpar.costmodel.specs import ModelSpec


def test_each_axis_hand_checked():
    assert divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(1) == [1]
    assert context_splits(8, 16) == [1, 2, 4, 8]  # 2·cp chunks of 16 tokens
    assert context_splits(8, 12) == [1, 2]  # 12 is not 8 or 16 chunks
    llama = model_preset("llama3-405b")  # 128 heads, 8 key/value heads
    assert heads_split(llama, 8) is None
    assert heads_split(llama, 16) == "t = 16 does not divide heads (128, kv 8)"
    assert batch_splits(12, 2) == [1, 2, 3, 6]
    assert expert_splits(MoESpec(experts=8, ffn=16), 12) == [1, 2, 4] and expert_splits(None, 12) == [1]
    assert sequence_parallel_choices(1) == (False,) and sequence_parallel_choices(2) == (False, True)
    assert shards(0, 1) and not shards(1, 1) and shards(3, 2)


def test_the_trainers_planner_tries_only_the_context_splits_of_the_axis():
    model = ModelSpec(4, 32, 4, 12, 64)  # s = 12: cp 2 (4 chunks) splits it, cp 4 (8 chunks) does not
    caps = Capabilities(schedules=("1f1b",), recompute=("none",), sequence_parallel=False, max_microbatches=2)
    seen = {(r.t, r.cp) for r in layouts(model, 4, 8, caps, LocalLayout(model))}
    assert {cp for _, cp in seen} == {1, 2}
    assert all(cp in context_splits(4 // t, model.seq) for t, cp in seen)


class _Grid(Planner):
    """Walks (t, cp, cp_comm, p, d) as ``axes`` gives them, records every leaf, refuses d not dividing ``batch``."""

    order = ("t", "cp", "cp_comm", "p", "d")

    def __init__(self) -> None:
        self.leaves: list[tuple[int, int, str, int, int]] = []
        self.rejected: Counter[str] = Counter()

    def valid(self, name: str, chosen: Chosen) -> bool:
        if name == "d" and chosen["batch"] % chosen["d"]:
            self.rejected["batch"] += 1
            return False
        return True

    def leaf(self, chosen: Chosen) -> Outcome:
        self.leaves.append((chosen["t"], chosen["cp"], chosen["cp_comm"], chosen["p"], chosen["d"]))
        return True


def test_walk_yields_the_grid_of_the_axes():
    grid = _Grid()
    assert walk(grid, {"world": 4, "batch": 4, "seq": 4}) == (True, None)
    assert grid.leaves == [  # s = 4: cp 2 (4 chunks) splits it, cp 4 does not; cp > 1 with each mode
        (1, 1, "ring", 1, 4), (1, 1, "ring", 2, 2), (1, 1, "ring", 4, 1),
        (1, 2, "ring", 1, 2), (1, 2, "ring", 2, 1), (1, 2, "allgather", 1, 2), (1, 2, "allgather", 2, 1),
        (2, 1, "ring", 1, 2), (2, 1, "ring", 2, 1), (2, 2, "ring", 1, 1), (2, 2, "allgather", 1, 1),
        (4, 1, "ring", 1, 1)]
    assert not grid.rejected


def test_walk_counts_what_a_rule_refuses():
    grid = _Grid()
    walk(grid, {"world": 6, "batch": 4, "seq": 2})  # cp 1 only; d = 6, 3 (twice) do not divide 4
    assert grid.rejected == Counter(batch=3)
    assert [(t, p, d) for t, _, _, p, d in grid.leaves] == [(1, 3, 2), (1, 6, 1), (2, 3, 1), (3, 1, 2), (3, 2, 1),
                                                            (6, 1, 1)]


class _Pruned(Planner):
    """Megatron's pruning on (b, v): a b whose first v does not fit ends the b loop."""

    order = ("micro_batch", "v")

    def __init__(self) -> None:
        self.tried: list[tuple[int, int]] = []

    def options(self, axis: Axis, chosen: Chosen) -> Sequence[Any]:
        return (1, 2) if axis.name == "v" else axis.values(chosen)

    def ends(self, name: str, index: int, outcome: Outcome) -> str | None:
        return "micro_batch" if name == "v" and index == 0 and outcome is False else None

    def leaf(self, chosen: Chosen) -> Outcome:
        self.tried.append((chosen["micro_batch"], chosen["v"]))
        return chosen["micro_batch"] <= 2 and chosen["v"] == 1  # v = 2 never fits: it ends nothing


def test_a_hook_ends_the_micro_batch_loop_at_the_first_that_does_not_fit():
    pruned = _Pruned()
    assert walk(pruned, {"batch": 16, "d": 2}) == (True, None)  # b in 1, 2, 4, 8: b = 4 does not fit, 8 is not tried
    assert pruned.tried == [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1)]


def test_the_published_search_counts_its_refusals_by_reason():
    gpt3, cluster = model_preset("gpt3-175b"), make_cluster("a100-80gb", 64)
    res = search(gpt3, cluster, 1536, t=3)
    assert res.rejected == Counter(pins=1) and res.example == {"pins": "t = 3 does not divide the 64 GPUs"}
    res = search(gpt3, cluster, 1536, micro_batch=7)  # every (t, p, d, recompute, SP) with t | 96: b = 7 refused
    assert not res.ranked and res.rejected == Counter(heads=1, pins=414)
    assert res.example["pins"] == "micro_batch = 7 does not divide batch/d = 24"
    assert PUBLISHED[-3:] == ("micro_batch", "v", "zero")  # the order its pruning needs


def test_a_sequence_parallel_pin_at_t_1_is_refused_with_its_reason():
    """It gave nothing and no reason ("no layout matches the pinned values"); now it is counted like other pins."""
    gpt3, cluster = model_preset("gpt3-175b"), make_cluster("a100-80gb", 64)
    res = search(gpt3, cluster, 64, t=1, sequence_parallel=True)
    assert not res.ranked and set(res.rejected) == {"pins"}
    assert res.example == {"pins": "sequence parallelism needs t > 1 to split over, got t = 1"}
    assert search(gpt3, cluster, 64, t=2, sequence_parallel=True).rejected["pins"] == 0  # t = 2 has a group
