"""Partitioning an nn.Sequential into balanced stages: exact min-max cuts, by size and by time."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from modelpar.pipeline import balance_by_cost, balance_by_size, balance_by_time, layer_times, split_sequential


def stage_costs(costs, balance):
    edges = list(itertools.accumulate([0, *balance]))
    return [sum(costs[a:b]) for a, b in zip(edges, edges[1:])]


@pytest.mark.parametrize(
    ("costs", "k", "expected"),
    [
        ([1, 1, 1, 1], 2, [2, 2]),
        ([4, 1, 1, 1, 1], 2, [1, 4]),
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, [5, 2, 2]),  # stage costs 15, 13, 17: the only cut with max 17
        ([5, 0, 5, 0, 5, 0, 5, 0], 2, [4, 4]),  # ReLUs weigh nothing: ties keep layer counts even
        ([3, 1, 2], 3, [1, 1, 1]),
        ([7], 1, [1]),
    ],
)
def test_hand_checked_cuts(costs, k, expected):
    assert balance_by_cost(costs, k) == expected


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=8), st.integers(1, 8))
def test_cut_is_optimal_against_brute_force(costs, k):
    k = min(k, len(costs))
    balance = balance_by_cost(costs, k)
    assert len(balance) == k and sum(balance) == len(costs) and min(balance) >= 1
    best = min(max(stage_costs(costs, [b - a for a, b in zip((0, *cuts), (*cuts, len(costs)))]))
               for cuts in itertools.combinations(range(1, len(costs)), k - 1))
    assert max(stage_costs(costs, balance)) == best


def test_balance_by_size_counts_parameters():
    seq = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 100), nn.ReLU())
    assert balance_by_size(seq, 2) == [4, 2]  # 110 + 110 params | 1100 params
    assert balance_by_size(seq, 6) == [1] * 6


class _Clock:
    """A clock that only the layers below move: a measured time is exactly the cost they charged."""

    now = 0.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.now


class _Charge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, backward_cost):
        ctx.backward_cost = backward_cost
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        _Clock.now += ctx.backward_cost
        return grad, None


class Costly(nn.Module):
    """A layer whose forward costs ``forward`` and whose backward costs ``backward`` seconds of ``_Clock``."""

    def __init__(self, forward: float, backward: float) -> None:
        super().__init__()
        self.cost = (forward, backward)

    def forward(self, x):
        _Clock.now += self.cost[0]
        return _Charge.apply(x, self.cost[1])


@pytest.fixture
def clock(monkeypatch):
    import modelpar.pipeline.partition as partition

    _Clock.now = 0.0
    monkeypatch.setattr(partition, "time", _Clock)  # the module's clock only: pytest keeps the real one
    return _Clock


def test_balance_by_time_isolates_the_slow_layer(clock):
    seq = nn.Sequential(Costly(1, 2), Costly(1, 2), Costly(3, 6))
    sample = torch.randn(2, 3)
    assert layer_times(seq, sample, repeats=2) == [3, 3, 9]  # forward + backward of each layer
    assert balance_by_time(seq, sample, 2, repeats=2) == [2, 1]  # 6 | 9, not 3 | 12


def test_layer_times_runs_backward_and_leaves_no_gradients(clock):
    seq = nn.Sequential(nn.Linear(3, 4), Costly(0.5, 0.25), nn.ReLU(), nn.Linear(4, 1))
    assert layer_times(seq, torch.randn(5, 3), repeats=1) == [0, 0.75, 0, 0]  # the backward was timed too
    assert all(p.grad is None for p in seq.parameters())


def test_split_sequential_keeps_the_layers_and_their_order():
    layers = [nn.Linear(2, 2) for _ in range(5)]
    stages = split_sequential(nn.Sequential(*layers), [2, 1, 2])
    assert [list(s) for s in stages] == [layers[:2], layers[2:3], layers[3:]]
    x = torch.randn(3, 2)
    torch.testing.assert_close(stages[2](stages[1](stages[0](x))), nn.Sequential(*layers)(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: balance_by_cost([1, 2, 3], 4), r"partitions \(4\) must be <= the number of layers \(3\)"),
        (lambda: balance_by_cost([1, 2], 0), "partitions must be >= 1, got 0"),
        (lambda: balance_by_cost([], 1), "costs must hold at least one layer"),
        (lambda: balance_by_cost([1, -2], 1), "costs must be >= 0"),
        (lambda: balance_by_cost([1, float("nan")], 1), "costs must be >= 0"),
        (lambda: balance_by_size(nn.Sequential(nn.ReLU()), 2), r"partitions \(2\) must be <= the number of layers \(1\)"),
        (lambda: balance_by_size(nn.Linear(2, 2), 1), "module must be an nn.Sequential, got Linear"),
        (lambda: split_sequential(nn.Sequential(nn.ReLU()), [0, 1]), r"balance\[0\] must be >= 1, got 0"),
        (lambda: split_sequential(nn.Sequential(nn.ReLU()), []), "balance must be a non-empty list"),
        (lambda: layer_times(nn.Sequential(nn.ReLU()), [1.0]), "sample must be a tensor, got list"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_layer_times_leaves_the_model_untouched():
    from modelpar.pipeline.partition import layer_times

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model[0].weight.grad = torch.ones_like(model[0].weight)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layer_times(model, torch.randn(8, 4), repeats=2)
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))  # not wiped
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BN stats unchanged
