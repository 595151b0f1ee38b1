"""The layout axes both planners search (``costmodel.axes``): each axis's values and rule, hand-checked, and the
two planners reading the same rule (issue 38: a dimension's axis in one place)."""

from modelpar.costmodel.axes import (
    batch_splits,
    context_splits,
    divisors,
    expert_splits,
    heads_split,
    sequence_parallel_choices,
    shards,
)
from modelpar.costmodel.local_memory import LocalLayout
from modelpar.costmodel.local_search import Capabilities, layouts
from modelpar.costmodel.moe import MoESpec
from modelpar.costmodel.presets import model_preset
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
