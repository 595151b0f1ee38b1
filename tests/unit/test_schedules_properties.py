"""Hypothesis properties over random K, M, v and costs: validity, closed forms, ASAP timing."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelpar.formulas import bubble_over_ideal_compute
from modelpar.schedules import Schedule, get_schedule, gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from modelpar.schedules import diagnosis as V
from modelpar.schedules.replay import replay_traced
from modelpar.simulate import Costs, simulate

K = st.integers(1, 7)
M = st.integers(1, 20)
cost = st.floats(0.05, 5.0, allow_nan=False)
SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def schedules(draw):
    name = draw(st.sampled_from(["naive", "gpipe", "1f1b", "interleaved", "zb-h1"]))
    k = draw(K)
    if name == "interleaved":
        return get_schedule(name, ranks=k, microbatches=k * draw(st.integers(1, 4)), chunks=draw(st.integers(1, 4)))
    return get_schedule(name, ranks=k, microbatches=draw(M))


@SETTINGS
@given(schedules())
def test_every_generated_schedule_validates_and_round_trips(s):
    s.validate()
    back = Schedule.from_text(s.to_text())
    assert back.actions == s.actions and back.stage_to_rank == s.stage_to_rank


@SETTINGS
@given(schedules(), cost, cost, st.floats(0, 2), st.data())
def test_simulated_actions_start_as_soon_as_possible(s, t_f, t_b, transfer, data):
    """Independent re-check of the engine: rank order, dependencies + transfer, no slack."""
    mult = tuple(data.draw(st.lists(cost, min_size=s.num_stages, max_size=s.num_stages)))
    tl = simulate(s, Costs(forward=t_f, backward=t_b, transfer=transfer, stage_multipliers=mult))
    end = {a: e for acts, ends in zip(tl.actions, tl.ends) for a, e in zip(acts, ends)}
    for d in range(tl.num_ranks):
        prev = 0.0
        for a, start, stop in zip(tl.actions[d], tl.starts[d], tl.ends[d]):
            ready = [prev] + [
                end[dep] + (transfer if s.is_transfer(dep, a) else 0.0) for dep in s.dependencies(a)
            ]
            assert start == pytest.approx(max(ready), abs=1e-9)
            assert stop >= start
            prev = stop


@SETTINGS
@given(st.sampled_from([gpipe, one_f_one_b]), K, M, cost, cost)
def test_zero_transfer_step_time_is_m_plus_k_minus_1_times_tf_plus_tb(gen, k, m, t_f, t_b):
    t = simulate(gen(ranks=k, microbatches=m), Costs(forward=t_f, backward=t_b))
    assert t.step_time == pytest.approx((m + k - 1) * (t_f + t_b), rel=1e-12)


@SETTINGS
@given(K, M)
def test_1f1b_peak_on_device_d_is_at_most_k_minus_d(k, m):
    peaks = simulate(one_f_one_b(ranks=k, microbatches=m)).peak_held
    assert peaks == [min(k - d, m) for d in range(k)]
    # counted until W (schedules.memory): ZB-H1's deferred W's keep min(K, m) on every device, not K - d
    assert simulate(zb_h1(ranks=k, microbatches=m)).peak_held == [min(k, m)] * k
    assert simulate(gpipe(ranks=k, microbatches=m)).peak_held == [m] * k


@SETTINGS
@given(K, st.integers(0, 12), cost)
def test_zb_h1_matches_closed_form_when_m_at_least_k(k, extra, t):
    m = k + extra
    zb = simulate(zb_h1(ranks=k, microbatches=m), Costs(forward=t, backward=2 * t))  # T_F = T_B(I) = T_W = t
    assert zb.step_time == pytest.approx(3 * m * t + (k - 1) * t, rel=1e-12)  # (K-1)(T_F+T_B-T_W)


@SETTINGS
@given(K, M, cost, cost, st.floats(0, 1))
def test_zb_h1_never_slower_than_1f1b(k, m, t_f, t_b, w_share):
    c = Costs(forward=t_f, backward=t_b, weight=w_share * t_b)
    zb, base = simulate(zb_h1(ranks=k, microbatches=m), c), simulate(one_f_one_b(ranks=k, microbatches=m), c)
    assert zb.step_time <= base.step_time + 1e-9


@SETTINGS
@given(st.integers(2, 6), st.integers(1, 5), st.integers(1, 4), cost)
def test_interleaved_bubble_is_megatron_formula(k, rounds, v, t):
    m = k * rounds
    tl = simulate(interleaved_1f1b(ranks=k, microbatches=m, chunks=v), Costs(forward=t))
    assert max(tl.idle) / (3 * t * m) == pytest.approx(bubble_over_ideal_compute(k, m, v), rel=1e-9)


@settings(max_examples=150, deadline=None)
@given(schedules(), st.integers(0, 2**32 - 1), st.sampled_from(["swap", "drop", "dup", "move"]))
def test_mutated_schedules_fast_and_clear_checks_agree(s, seed, how):
    """The linear engine and the slow, clear diagnosis never disagree, and nothing hangs."""
    rng = random.Random(seed)
    lists = [list(a) for a in s.actions]
    d = rng.randrange(len(lists))
    i, j = rng.randrange(len(lists[d])), rng.randrange(len(lists[d]))
    if how == "swap":
        lists[d][i], lists[d][j] = lists[d][j], lists[d][i]
    elif how == "drop":
        del lists[d][i]
    elif how == "dup":
        lists[d].insert(j, lists[d][i])
    else:
        lists[d].insert(j, lists[d].pop(i))
    mutated = Schedule(s.stage_to_rank, lists, "mutated")
    checks = (V._placement, V._kinds, V._duplicates, V._missing, V._local_order,
              lambda m: V._deadlock(m, replay_traced(m).stuck))  # reached only when the others pass
    first = next((msg for msg in (check(mutated) for check in checks) if msg), "")  # as diagnose does
    try:
        mutated.validate()
    except ValueError as err:
        assert first and str(err).endswith(first)
    else:
        assert not first
