"""Held memory counted until the last action that reads it (W), and the zero-bubble / V schedules
planned with the given F, I, W costs keeping their papers' bounds (issue 39)."""

import math

import pytest

from modelpar.schedules import get_schedule
from modelpar.schedules.action import Action, Kind
from modelpar.schedules.memory import W_KEEPS, peak_held, peak_held_bytes
from modelpar.schedules.registry import schedule_entry, schedule_names
from modelpar.schedules.validate import validate_schedule
from modelpar.simulate import simulate
from modelpar.simulate.costs import Costs

F, I, W, B = Kind.F, Kind.I, Kind.W, Kind.B
P, M = 8, 16
COSTS = {"1:1:1": (1.0, 1.0, 1.0), "1:1.2:0.8": (1.0, 1.2, 0.8)}  # T_F : T_I : T_W, each summing to 3


def _costs(fiw):
    f, i, w = fiw
    return Costs(forward=f, backward=i + w, weight=w), {F: f, I: i, W: w}


def _acts(text):
    return [Action.parse(a) for a in text.split()]


def test_held_until_w_hand_checked():
    """F holds a microbatch until its W (a pending W keeps the whole microbatch: ``W_KEEPS``), or its B."""
    assert W_KEEPS == 1.0
    assert peak_held([_acts("0F0 0I0 0F1 0W0 0I1 0W1")], 1) == [2.0]  # 0F1 while 0W0 is pending
    assert peak_held([_acts("0F0 0I0 0W0 0F1 0I1 0W1")], 1) == [1.0]
    assert peak_held([_acts("0F0 0F1 0B0 0B1")], 1) == [2.0]
    assert peak_held([_acts("0F0 1F0 1I0 1W0 0I0 0W0")], 2) == [1.0]  # two chunks of one microbatch: 1/2 each


def test_held_bytes_weigh_each_stage_hand_checked():
    """The same walk in bytes: stage 0 weighs 10, stage 1 weighs 3 (a V's two chunks on one rank)."""
    assert peak_held_bytes([_acts("0F0 1F0 1I0 0F1 1W0 0I0 0W0 1F1 1B1 0B1")], [10, 3]) == [23]  # 0F1: 10 + 3 + 10
    assert peak_held_bytes([_acts("0F0 0F1 0B0 0B1")], [10]) == [20]
    for name in ("1f1b", "zb-h2", "v-min"):  # equal weights: the count times the weight
        s = get_schedule(name, ranks=4, microbatches=8)
        assert peak_held_bytes(s.actions, [5.0] * s.num_stages) == [5 * s.chunks * x for x in peak_held(s.actions, s.chunks)]


def test_shared_bytes_held_whole_while_any_microbatch_is_hand_checked():
    """What a stage's microbatches share (the batch their ids are views of) counts once, from the first F of
    the stage until none of its microbatches is held, and again when one is."""
    assert peak_held_bytes([_acts("0F0 0F1 0B0 0F2 0B1 0B2")], [10], [4]) == [24]  # 4 + 10 + 10, never 4 twice
    assert peak_held_bytes([_acts("0F0 1F0 1B0 0B0 0F1 0B1")], [10, 3], [4, 0]) == [17]  # 0F0 1F0: 14 + 3
    assert peak_held_bytes([_acts("0F0 0I0 0F1 0W0 0I1 0W1")], [10], [4]) == [24]  # until W
    assert peak_held_bytes([_acts("0F0 0I0 0W0 0F1 0I1 0W1")], [10], [4]) == [14]  # released, then held anew
    s = get_schedule("gpipe", ranks=2, microbatches=4)  # all 4 held at the peak: the whole batch is 4 shares
    assert peak_held_bytes(s.actions, [7.0, 7.0], [4.0, 0.0]) == peak_held_bytes(s.actions, [8.0, 7.0])


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zb-v", "v-half", "v-min", "dualpipe-v"])
@pytest.mark.parametrize("costs", list(COSTS))
def test_every_zero_bubble_schedule_holds_at_most_2p_minus_1(name, costs):
    sim, kinds = _costs(COSTS[costs])
    s = get_schedule(name, ranks=P, microbatches=M, costs=kinds)
    validate_schedule(s)
    assert max(simulate(s, sim).peak_held) <= 2 * P - 1


@pytest.mark.parametrize("costs", list(COSTS))
def test_zb_h2_interleaves_w_within_2p_minus_1(costs):
    """Qi et al. 2024a, ZB-H2: W's in the steady state, held <= 2p − 1 counted until W; at equal times
    the step is the start-up bound (p − 1)T_F + m(T_F + T_I + T_W)."""
    sim, kinds = _costs(COSTS[costs])
    s = get_schedule("zb-h2", ranks=P, microbatches=M, costs=kinds)
    tl = simulate(s, sim)
    assert tl.peak_held == [2 * P - 1] * P
    rank0 = [str(a) for a in s.actions[0]]
    assert rank0[-2:] == ["0I15", "0W15"]  # not the old "... 0I15 0W6 0W7 ... 0W15": only the last W after it
    first_w = next(i for i, a in enumerate(s.actions[0]) if a.kind is W)
    assert first_w < rank0.index("0F15")  # a W runs before the last forward: interleaved
    if costs == "1:1:1":
        assert tl.step_time == (P - 1) * 1 + M * 3 == 55


@pytest.mark.parametrize("k", [2, 3, 4, 6, 8])
def test_zb_h2_start_up_bound_at_equal_costs(k):
    for m in (2 * k, 4 * k):
        tl = simulate(get_schedule("zb-h2", ranks=k, microbatches=m))
        assert tl.step_time == (k - 1) + 3 * m and max(tl.peak_held) <= 2 * k - 1


@pytest.mark.parametrize("costs", list(COSTS))
def test_v_half_bound_and_never_slower_than_1f1b(costs):
    """Qi et al. 2024b: V-Half holds <= ⌈(p+2)/2⌉ and, with W + 2B >= 2F and W + 2F >= 2B, is no
    slower than 1F1B — here built from the given F, I, W."""
    sim, kinds = _costs(COSTS[costs])
    one = simulate(get_schedule("1f1b", ranks=P, microbatches=M), sim)
    half = simulate(get_schedule("v-half", ranks=P, microbatches=M, costs=kinds), sim)
    assert max(half.peak_held) <= math.ceil((P + 2) / 2)
    assert half.step_time <= one.step_time


def test_v_half_the_issue_example():
    """p = 4, m = 32, F:I:W = 1:1.2:0.8: V-Half took 115.3 against 1F1B's 105 when built for equal times."""
    sim, kinds = _costs(COSTS["1:1.2:0.8"])
    one = simulate(get_schedule("1f1b", ranks=4, microbatches=32), sim)
    half = simulate(get_schedule("v-half", ranks=4, microbatches=32, costs=kinds), sim)
    assert one.step_time == 105 and half.step_time <= one.step_time and max(half.peak_held) <= 3


@pytest.mark.parametrize("costs", list(COSTS))
def test_v_min_bound(costs):
    sim, kinds = _costs(COSTS[costs])
    vmin = simulate(get_schedule("v-min", ranks=P, microbatches=M, costs=kinds), sim)
    assert max(vmin.peak_held) <= math.ceil((P + 2) / 3)


def test_v_min_no_slower_than_1f1b_at_equal_costs():
    one = simulate(get_schedule("1f1b", ranks=P, microbatches=M))
    assert simulate(get_schedule("v-min", ranks=P, microbatches=M)).step_time <= one.step_time


@pytest.mark.parametrize("p, m, step", [(P, M, 67.4), (6, 12, 50.9)])
def test_v_min_no_slower_than_1f1b_at_unequal_costs(p, m, step):
    """1:1.2:0.8: no repeated block within ⌈(p+2)/3⌉ beats 1F1B (p = 8, m = 16: 72 vs 69); the windowed list
    schedule (``greedy`` with per-stage windows summing to the bound in chunks, forwards first) does."""
    sim, kinds = _costs(COSTS["1:1.2:0.8"])
    one = simulate(get_schedule("1f1b", ranks=p, microbatches=m), sim)
    vmin = simulate(get_schedule("v-min", ranks=p, microbatches=m, costs=kinds), sim)
    assert vmin.step_time == pytest.approx(step) and vmin.step_time <= one.step_time == 3 * (m + p - 1)
    assert max(vmin.peak_held) <= math.ceil((p + 2) / 3)


def test_windows_bound_each_stage_and_keep_the_defaults():
    """``greedy``'s per-stage windows: no stage holds more than its window (F until W), so a rank holds
    at most the sum of its stages'; without windows ZB-H2 is the same schedule as before."""
    from modelpar.schedules.greedy import greedy
    from modelpar.schedules.schedule import v_map

    win = [3, 2, 2, 1, 1, 1, 1, 1]
    s = greedy(v_map(4), 12, 8, windows=win)
    validate_schedule(s)
    for acts in s.actions:
        held: dict[int, int] = {}
        for a in acts:
            held[a.stage] = held.get(a.stage, 0) + (a.kind is F) - (a.kind is W)
            assert held[a.stage] <= win[a.stage]
    assert peak_held(s.actions, 2) <= [(win[d] + win[7 - d]) / 2 for d in range(4)]
    assert greedy(v_map(4), 8, 8) == greedy(v_map(4), 8, 8, windows=[9] * 8)  # never reached: no window
    s = greedy(v_map(4), 12, 8, windows=win, forward_first=True)
    validate_schedule(s)
    assert peak_held(s.actions, 2) <= [(win[d] + win[7 - d]) / 2 for d in range(4)]
    with pytest.raises(ValueError, match="windows must be one int >= 1 per stage"):
        greedy(v_map(4), 8, 8, windows=[0] * 8)


def test_costs_reach_only_the_generators_that_plan_with_them():
    takes = {n for n in schedule_names() if schedule_entry(n).takes_costs}
    assert takes == {"zb-h2", "v-half", "v-min"}
    kinds = {F: 1.0, I: 1.2, W: 0.8}
    assert get_schedule("1f1b", ranks=4, microbatches=8, costs=kinds) == get_schedule("1f1b", ranks=4, microbatches=8)
    with pytest.raises(ValueError, match="costs must give F, I and W times >= 0"):
        get_schedule("v-min", ranks=4, microbatches=8, costs={F: -1.0, I: 1.0, W: 1.0})
