"""The one layer-split rule: hand-checked splits, its properties, and that every user of it agrees."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelpar.costmodel import split_layers as planner_split
from modelpar.layer_split import balance_by_cost, check_split, layer_ranges, parse_split, resolve_split, split_layers
from modelpar.model import ModelConfig, layers_of_stage
from modelpar.pipeline import balance_by_cost as pipeline_balance
from modelpar.training import TrainConfig


def test_hand_checked_splits():
    assert split_layers(70, 12) == (5,) + (6,) * 10 + (5,)  # BLOOM: the embeddings count as layers
    assert split_layers(6, 4) == (1, 2, 2, 1) and split_layers(3, 2) == (1, 2) and split_layers(4, 4) == (1,) * 4
    assert split_layers(2, 4) == (0, 1, 1, 0)  # p·v = L + 2: the first and last hold only the embedding, head
    assert layer_ranges((0, 3, 2)) == [range(0, 0), range(0, 3), range(3, 5)]
    assert resolve_split(6, 2, 2) == (1, 2, 2, 1) and resolve_split(6, 2, 1, [2, 4]) == (2, 4)
    assert parse_split("5,6,6,5") == (5, 6, 6, 5)


@pytest.mark.parametrize("layers, p, v, split, message", [
    (6, 2, 1, (3, 2), "sums to 5, not the model's 6 layers"),
    (6, 2, 2, (3, 3), "2 entries, expected p·v = 2·2 = 4"),
    (6, 3, 1, (3, 0, 3), "only the first and last chunk may be empty"),
    (6, 2, 1, (7, -1), "entries must be whole numbers >= 0"),
    (2, 5, 1, None, "p·v = 5 chunks need at least 3 layers, not 2"),
])
def test_bad_splits_are_named(layers, p, v, split, message):
    assert message in check_split(layers, p, v, split)
    with pytest.raises(ValueError, match="stage_layers"):
        resolve_split(layers, p, v, split)


def test_bad_text_is_named():
    with pytest.raises(ValueError, match=r"--stage-layers must be comma-separated whole numbers, got '5,x'"):
        parse_split("5,x")


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 200), st.integers(1, 16), st.integers(1, 4))
def test_the_default_split_is_balanced_with_lighter_ends(layers, p, v):
    n = p * v
    if n > layers + 2:
        with pytest.raises(ValueError, match="chunks need at least"):
            split_layers(layers, p, v)
        return
    split = split_layers(layers, p, v)
    assert len(split) == n and sum(split) == layers and check_split(layers, p, v, split) is None
    assert max(split) == -(-layers // n) or layers < n  # no stage holds more than it must
    if n > 2:  # the ends (embedding, output layer) never hold more than a middle stage
        assert max(split[0], split[-1]) <= min(split[1:-1])
    ranges = layer_ranges(split)
    assert [i for r in ranges for i in r] == list(range(layers))  # every layer once, in order


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.integers(0, 9))
def test_equal_costs_give_the_default_split(layers, k, cost):
    k = min(k, layers)
    assert tuple(balance_by_cost([cost] * layers, k)) == split_layers(layers, k)


def test_planner_pipeline_model_and_trainer_share_the_rule():
    assert planner_split is split_layers and pipeline_balance is balance_by_cost
    model = ModelConfig(layers=70)
    cfg = TrainConfig(model=model, tp=1, pp=12, dp=1, batch_size=12, microbatches=12)
    assert cfg.layer_split == split_layers(70, 12) == tuple(len(layers_of_stage(model, s, 12)) for s in range(12))
    pinned = dataclasses.replace(cfg, pp=4, stage_layers=(17, 18, 18, 17), microbatches=4, batch_size=16)
    assert pinned.check().layer_split == (17, 18, 18, 17)
    v2 = dataclasses.replace(cfg, pp=2, schedule="interleaved", chunks=2, microbatches=4, batch_size=16,
                             model=ModelConfig(layers=6))
    assert v2.check().layer_split == (1, 2, 2, 1)  # per virtual stage, in pipeline order: device 0 holds 1 + 2
