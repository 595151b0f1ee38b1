"""The simulator against the reference text's numbers (§1.2, §2.3, §4.1–4.2) and the closed forms."""

import pytest

from modelpar.formulas import bubble_over_ideal_compute
from modelpar.schedules import Schedule, gpipe, interleaved_1f1b, naive, one_f_one_b, zb_h1
from modelpar.simulate import (
    Costs,
    Event,
    Timeline,
    bubble_fraction_of_step,
    min_microbatches_for_bubble,
    one_f_one_b_bubble_time,
    pipeline_speedup,
    simulate,
    zb_h1_bubble_time,
)

HALF = Costs(transfer=0.5)


def test_naive_utilisation_is_one_over_k_and_20_percent_with_transfer():  # §1.2
    t = simulate(naive(ranks=4))
    assert t.step_time == 12 and 1 - t.bubble == pytest.approx(0.25, abs=1e-12)
    assert t.bubble_per_rank == pytest.approx([0.75] * 4, abs=1e-12)
    t = simulate(naive(ranks=4), HALF)
    assert t.step_time == 15 and 1 - t.bubble == pytest.approx(0.20, abs=1e-12)


def test_gpipe_k4_m8_is_33_units_with_27_3_percent_bubble():  # §2.3
    t = simulate(gpipe(ranks=4, microbatches=8))
    assert t.step_time == 33
    assert round(t.bubble, 3) == 0.273
    assert t.idle == [9.0] * 4
    assert t.peak_held == [8.0] * 4
    assert t.transfers == 2 * 8 * 3


def test_gpipe_simulator_equals_formula_to_rounding():  # §2.3: "max difference 5.6e-17"
    diff = max(abs(simulate(gpipe(ranks=k, microbatches=m)).bubble - bubble_fraction_of_step(stages=k, microbatches=m))
               for k in range(1, 9) for m in range(1, 40))
    assert diff < 1e-15


def test_m_equal_4k_still_leaves_16_to_18_percent():  # §2.3
    assert [round(100 * bubble_fraction_of_step(stages=k, microbatches=4 * k)) for k in (4, 8)] == [16, 18]


@pytest.mark.parametrize("k", [2, 4, 8, 16])
def test_below_5_percent_needs_m_above_19_k_minus_1(k):  # §2.3
    m = min_microbatches_for_bubble(k, 0.05)
    assert m == 19 * (k - 1) + 1
    assert simulate(gpipe(ranks=k, microbatches=m)).bubble < 0.05 <= simulate(gpipe(ranks=k, microbatches=m - 1)).bubble


def test_throughput_vs_one_device():  # §2.3 throughput table
    formula = pipeline_speedup(stages=8, microbatches=32)
    assert round(simulate(gpipe(ranks=8, microbatches=32)).speedup, 2) == 6.56 == round(formula, 2)
    assert [simulate(gpipe(ranks=k, microbatches=1)).speedup for k in (1, 2, 4, 8)] == [1.0] * 4


def test_transfer_half_a_forward_makes_m1_slower_than_one_device():  # §2.3: 0.77-0.86x
    speedups = [simulate(gpipe(ranks=k, microbatches=1), HALF).speedup for k in (2, 4, 8)]
    assert [round(s, 2) for s in speedups] == [0.86, 0.80, 0.77]
    at32 = simulate(gpipe(ranks=8, microbatches=32), HALF).speedup
    assert at32 == pytest.approx(pipeline_speedup(stages=8, microbatches=32, comm=0.5), rel=1e-12)
    assert 0.9 * 6.56 < at32 < 6.56  # "only a bit less": transfers hide under other microbatches


def test_1f1b_k4_m8_same_step_peaks_4_3_2_1():  # §4.1
    t = simulate(one_f_one_b(ranks=4, microbatches=8))
    assert t.step_time == 33 and round(t.bubble, 3) == 0.273
    assert t.peak_held == [4.0, 3.0, 2.0, 1.0]


def test_with_transfer_1f1b_bubble_exceeds_gpipe():  # §4.1: 16.8% vs 9.6% at M = 32, T = 0.2
    c = Costs(transfer=0.2)
    assert round(100 * simulate(one_f_one_b(ranks=4, microbatches=32), c).bubble, 1) == 16.8
    assert round(100 * simulate(gpipe(ranks=4, microbatches=32), c).bubble, 1) == 9.6


def test_interleaved_halves_bubble_time_and_peak_rises_to_5_5():  # §4.2
    plain, inter = simulate(one_f_one_b(ranks=4, microbatches=8)), simulate(interleaved_1f1b(ranks=4, microbatches=8, chunks=2))
    assert inter.idle[0] == plain.idle[0] / 2 == 4.5
    assert inter.peak_held[0] == 5.5
    assert inter.transfers > 2 * plain.transfers


@pytest.mark.parametrize("k, m, v", [(2, 4, 2), (4, 8, 2), (4, 16, 4), (3, 9, 3), (8, 16, 2)])
def test_interleaved_equals_megatron_formula(k, m, v):  # (1/v)(K - 1)/M, relative to ideal compute
    t = simulate(interleaved_1f1b(ranks=k, microbatches=m, chunks=v))
    ideal = m * 3.0
    assert t.idle[0] / ideal == pytest.approx(bubble_over_ideal_compute(k, m, v), abs=1e-12)


def test_v4_worse_than_v2_at_every_m_with_transfer():  # §4.2
    c = Costs(transfer=0.2)
    for m in (4, 8, 16, 32, 64):
        v4, v2 = (simulate(interleaved_1f1b(ranks=4, microbatches=m, chunks=v), c) for v in (4, 2))
        assert v4.step_time > v2.step_time


def test_zb_h1_one_third_of_1f1b_bubble_same_peak():  # Qi et al. §3.1, T_F = T_B = T_W
    zb, base = simulate(zb_h1(ranks=4, microbatches=8)), simulate(one_f_one_b(ranks=4, microbatches=8))
    assert zb.idle[0] == base.idle[0] / 3 == zb_h1_bubble_time(4, 1, 1, 1)
    assert base.peak_held == [4.0, 3.0, 2.0, 1.0]
    assert zb.peak_held[0] == 4.0 and zb.peak_held[3] == 4.0  # a deferred W keeps its microbatch held


def test_one_f_one_b_bubble_time_formula():
    assert one_f_one_b_bubble_time(4, 1, 2) == 9 == simulate(one_f_one_b(ranks=4, microbatches=8)).idle[0]


def test_unbalanced_stages_and_chunk_costs():
    t = simulate(gpipe(ranks=2, microbatches=1), Costs(stage_multipliers=(1.0, 3.0)))
    assert [(e.start, e.end) for e in t.events] == [(0, 1), (10, 12), (1, 4), (4, 10)]
    t = simulate(interleaved_1f1b(ranks=2, microbatches=2, chunks=2))
    assert t.events[0].end - t.events[0].start == 0.5  # a chunk is half a stage


def test_split_backward_costs_default_half_half_and_custom_weight():
    assert simulate(zb_h1(ranks=1, microbatches=1)).step_time == 3
    t = simulate(zb_h1(ranks=1, microbatches=1), Costs(backward=2, weight=0.5))
    assert [e.end - e.start for e in t.events] == [1, 1.5, 0.5]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"forward": -1}, r"forward must be >= 0.0, got -1"),
        ({"transfer": float("nan")}, r"transfer must be a finite number"),
        ({"backward": 1, "weight": 2}, r"weight .* must be <= backward \(1\), got 2"),
        ({"stage_multipliers": (1, -2)}, r"stage_multipliers\[1\] must be >= 0.0, got -2"),
    ],
)
def test_bad_costs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Costs(**kwargs)


def test_multipliers_must_match_stages():
    with pytest.raises(ValueError, match=r"stage_multipliers must have one entry per stage \(4\), got 2"):
        simulate(gpipe(ranks=4, microbatches=2), Costs(stage_multipliers=(1, 1)))


def test_simulate_rejects_a_deadlocking_schedule_without_hanging():
    s = Schedule.from_text("0F0 0B0 0F1 0B1\n1F1 1F0 1B0 1B1")
    with pytest.raises(ValueError, match="deadlock"):
        simulate(s)


def test_timeline_from_measured_events_shifts_to_zero_and_computes_metrics():
    s = one_f_one_b(ranks=2, microbatches=2)
    t0 = 1000.0  # a measured clock
    events = [
        (0, s.actions[0][0], t0 + 0.0, t0 + 1.0), (0, s.actions[0][1], t0 + 1.0, t0 + 2.0),
        (1, s.actions[1][0], t0 + 1.0, t0 + 2.0), (1, s.actions[1][1], t0 + 2.0, t0 + 4.0),
        (1, s.actions[1][2], t0 + 4.0, t0 + 5.0), (1, s.actions[1][3], t0 + 5.0, t0 + 7.0),
        (0, s.actions[0][2], t0 + 4.0, t0 + 6.0), (0, s.actions[0][3], t0 + 7.0, t0 + 9.0),
    ]
    t = Timeline.from_events(events, 2, s)
    assert t.step_time == 9 and t.busy == [6, 6]
    assert t.bubble == pytest.approx(1 / 3)
    assert t.peak_held == [2, 1] and t.transfers == 4
    assert t.events[0] == Event(0, s.actions[0][0], 0.0, 1.0)
    assert Timeline.from_events(events, 2).transfers == 4  # stage -> device inferred from the events
    with pytest.raises(ValueError, match=r"event rank must be in 0..0, got 1"):
        Timeline.from_events(events, 1)
    with pytest.raises(ValueError, match=r"event end must be >= start"):
        Timeline.from_events([(0, s.actions[0][0], 2.0, 1.0)], 1)

