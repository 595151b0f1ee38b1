"""``--schedule auto``: never worse than the family under the same memory limit; the frontier; bad limits."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelpar.cli import main
from modelpar.schedules import Kind, get_schedule, lower, schedule_names
from modelpar.schedules.lower import rendezvous
from modelpar.schedules.registry import schedule_entry
from modelpar.simulate.synthesis import StageCosts, candidates, pareto, synthesize


def _best_named(k, m, costs, limit):
    best = None
    for name in schedule_names():
        if (name == "interleaved" and m % k) or (name.startswith("dualpipe-v") and m < 2 * k):
            continue
        tl = costs.timeline(get_schedule(name, ranks=k, microbatches=m, chunks=schedule_entry(name).default_chunks,
                                         costs=costs.per_kind()))
        if max(tl.peak_held) <= limit + 1e-9 and (best is None or tl.step_time < best.step_time):
            best = tl
    return best


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 4), st.sampled_from([4, 6, 8]), st.sampled_from([(1, 1, 1), (1, 2, 0.5), (1, 1, 0.3), (2, 1, 1)]),
       st.sampled_from([0.0, 0.3]), st.sampled_from([1.0, 1.5, 2.0, 3.0, 4.0, 8.0]))
def test_never_worse_than_the_best_named_schedule_within_the_limit(k, m, fiw, transfer, limit):
    costs = StageCosts.uniform(k, *fiw, transfer=transfer)
    schedule, tl = synthesize(k, m, costs, limit)
    assert max(tl.peak_held) <= limit + 1e-9
    named = _best_named(k, m, costs, limit)
    assert named is None or tl.step_time <= named.step_time + 1e-9
    assert rendezvous(lower(schedule), schedule.stage_to_rank) is None  # it runs: valid, no hang


def test_the_family_planned_with_the_costs_in_the_synthesis():
    """K = 4, M = 8, I three times W, transfer 0.1, at most 3 microbatches held (until W): V-Half built
    from these costs (33.6 units; 42.55 built for equal times) beats every list-scheduler candidate, and
    the synthesis, which builds the family with its costs, returns it."""
    costs = StageCosts.uniform(4, 1, 1.5, 0.5, transfer=0.1)
    schedule, tl = synthesize(4, 8, costs, 3)
    named = _best_named(4, 8, costs, 3)
    assert named.name == "v-half" and named.step_time == pytest.approx(33.6)
    assert costs.timeline(get_schedule("v-half", ranks=4, microbatches=8)).step_time == pytest.approx(42.55)
    assert schedule.name == "v-half" and tl.step_time == pytest.approx(33.6)
    assert max(tl.peak_held) <= 3


def test_per_stage_costs_cut_into_chunks():
    """Two whole stages (F 1 and 2, I 2 and 4, W 1): v = 2 cuts each into two halves."""
    costs = StageCosts((1, 2), (2, 4), (1, 1))
    v = get_schedule("interleaved", ranks=2, microbatches=4, chunks=2)  # stages 0..3: whole stages 0, 0, 1, 1
    assert costs.durations(v)[Kind.F] == [0.5, 0.5, 1.0, 1.0]
    assert costs.durations(v)[Kind.B] == [1.5, 1.5, 2.5, 2.5]


def test_limit_below_any_schedule_names_the_smallest_that_works():
    with pytest.raises(ValueError, match=r"memory limit must be >= 1 microbatches' activations per rank .*got 0.5"):
        synthesize(4, 8, StageCosts.uniform(4), 0.5)
    with pytest.raises(ValueError, match=r"costs must give 4 stages' times"):
        synthesize(4, 8, StageCosts.uniform(3), 2)


def test_pareto_keeps_what_nothing_beats_on_both():
    costs = StageCosts.uniform(4)
    tls = [costs.timeline(s) for s in candidates(4, 8, costs)]
    front = pareto(tls)
    peaks = [max(t.peak_held) for t in front]
    steps = [t.step_time for t in front]
    assert peaks == sorted(peaks) and steps == sorted(steps, reverse=True) and len(set(peaks)) == len(peaks)
    for t in tls:  # every candidate is matched or beaten by a frontier point with no more memory
        assert any(max(f.peak_held) <= max(t.peak_held) and f.step_time <= t.step_time for f in front)


def test_cli_auto_pareto_png_and_bad_limit(capsys, tmp_path):
    assert main(["simulate", "--schedule", "auto", "--memory-limit", "3", "--costs", "1:1.5:0.5",
                 "--transfer", "0.1"]) == 0
    out = capsys.readouterr().out
    # V-Half built from these costs wins (test_the_family_planned_with_the_costs_in_the_synthesis)
    assert out.startswith("v-half (K = 4, M = 8") and "peak held microbatches per rank" in out
    png = tmp_path / "pareto.png"
    assert main(["simulate", "--pareto", "--costs", "1:1:1", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "* = on the frontier" in out and "zb-v" in out and f"wrote {png}" in out and png.stat().st_size > 10_000
    assert main(["simulate", "--schedule", "auto", "--memory-limit", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "memory limit must be >= 1" in err
    assert main(["simulate", "--costs", "1:1", "--schedule", "auto"]) == 2
    assert "--costs must be F:I:W triples" in capsys.readouterr().err
