"""The action table (``modelpar.schedules.kinds``) against hand-checked rows, and every pass that
derives from it — dependencies, the timing engine, lowering, the runtime's plan — against the table."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_lower import generated, hand_written

from modelpar.pipeline.program import COMPUTE, build_plan
from modelpar.schedules import Action, Kind, Schedule, lower
from modelpar.schedules.kinds import ACT, DEFERRED, GRAD, GRAPH, SPECS, STYLES, inputs_of, producers, style_of
from modelpar.schedules.lower import Transfer
from modelpar.schedules.replay import replay_times, replay_traced

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W
SETTINGS = settings(max_examples=60, deadline=None)


def test_table_rows_hand_checked():
    assert SPECS[F].consumes == (ACT,) and SPECS[F].produces == (ACT, GRAPH)
    assert SPECS[B].consumes == (GRAPH, GRAD) and SPECS[B].produces == (GRAD,)
    assert SPECS[I].consumes == (GRAPH, GRAD) and SPECS[I].produces == (GRAD, DEFERRED)
    assert SPECS[W].consumes == (DEFERRED,) and SPECS[W].produces == ()
    assert [k for k, s in SPECS.items() if s.weight_grads] == [B, W]
    assert inputs_of(F, 2) == [(ACT, 1)] and inputs_of(B, 2) == [(GRAPH, 2), (GRAD, 3)]
    assert (ACT.message, GRAD.message, GRAPH.message) == ("F", "B", "")


def test_styles_give_each_consumed_value_one_producer():
    assert producers((F, B)) == {ACT: F, GRAPH: F, GRAD: B}
    assert producers((F, I, W)) == {ACT: F, GRAPH: F, GRAD: I, DEFERRED: I}
    assert style_of({F}) == (F,) and style_of({B, F}) == (F, B) and style_of({W}) == (F, I, W)
    assert style_of({B, I}) is None  # a full backward mixed with a split one: no style
    for style in STYLES:
        made = [v for k in style for v in SPECS[k].produces]
        assert all(made.count(v) == 1 for k in style for v in SPECS[k].consumes)


@pytest.mark.parametrize("text, action, deps", [
    ("0F0 0B0\n1F0 1B0\n2F0 2B0", "0F0", []),
    ("0F0 0B0\n1F0 1B0\n2F0 2B0", "1F0", ["0F0"]),
    ("0F0 0B0\n1F0 1B0\n2F0 2B0", "1B0", ["1F0", "2B0"]),
    ("0F0 0B0\n1F0 1B0\n2F0 2B0", "2B0", ["2F0"]),
    ("0F0 0I0 0W0\n1F0 1I0 1W0", "0I0", ["0F0", "1I0"]),
    ("0F0 0I0 0W0\n1F0 1I0 1W0", "1W0", ["1I0"]),
])
def test_dependencies_hand_checked(text, action, deps):
    s = Schedule.from_text(text)
    assert [str(a) for a in s.dependencies(Action.parse(action))] == deps


def _reference_times(schedule, transfer):
    """Start times read straight off the table: repeat until every action sits at max(rank free,
    each producer's end + transfer if it crosses ranks). Slow and independent of ``replay_times``."""
    made = producers(schedule.style)
    dev = schedule.stage_to_rank
    end: dict[Action, float] = {}
    starts = [[0.0] * len(acts) for acts in schedule.actions]
    while len(end) < sum(map(len, schedule.actions)):
        for d, acts in enumerate(schedule.actions):
            free = 0.0
            for i, a in enumerate(acts):
                deps = [(Action(p, made[v], a.microbatch), p) for v, p in inputs_of(a.kind, a.stage)
                        if 0 <= p < schedule.num_stages]
                if any(x not in end for x, _ in deps):
                    break
                t = max([free] + [end[x] + (transfer if dev[p] != d else 0.0) for x, p in deps])
                starts[d][i], end[a] = t, t + 1.0
                free = t + 1.0
    return starts


@SETTINGS
@given(st.one_of(generated(), hand_written()), st.floats(0, 2))
def test_timing_engine_equals_the_table(schedule, transfer):
    x = [0.0] + [transfer if schedule.rank_of(s) != schedule.rank_of(s - 1) else 0.0
                 for s in range(1, schedule.num_stages)]
    starts, _ = replay_times(schedule, transfer_in=x)
    ref = _reference_times(schedule, transfer)
    assert all(a == pytest.approx(b, abs=1e-9) for sa, sb in zip(starts, ref) for a, b in zip(sa, sb))
    order = replay_traced(schedule).order  # the order lowering appends actions in: topological
    seen: set[Action] = set()
    for a in order:
        assert all(dep in seen for dep in schedule.dependencies(a))
        seen.add(a)
    assert len(order) == sum(map(len, schedule.actions))


@SETTINGS
@given(st.one_of(generated(), hand_written()))
def test_lowering_and_plan_follow_the_table(schedule):
    """Each value the table says crosses ranks is one SEND and one RECV; the plan's sources and
    sinks are the table's: the batch, the loss, a hand-over on the rank, or a message."""
    programs = lower(schedule)
    dev, last = schedule.stage_to_rank, schedule.num_stages - 1
    sends = {(op.message) for p in programs for op in p if isinstance(op, Transfer) and op.is_send}
    expected = {(v.message, a.stage, a.microbatch) for acts in schedule.actions for a in acts
                for v in SPECS[a.kind].produces if v.consumer and 0 <= a.stage + v.consumer <= last
                and dev[a.stage + v.consumer] != dev[a.stage]}
    assert sends == expected
    specs = {(s, r): ((r, 1), torch.float64) for s in range(schedule.num_stages) for r in (1,)}
    rows = [1] * schedule.num_microbatches
    for me, program in enumerate(programs):
        plan = [p for p in build_plan(program, schedule, me, specs, rows, torch.device("cpu")) if p.code == COMPUTE]
        for p in plan:
            a = p.op
            if a.kind is F:
                assert p.source == ("input" if a.stage == 0 else "local" if dev[a.stage - 1] == me else "recv")
                assert p.sink == ("loss" if a.stage == last else "local" if dev[a.stage + 1] == me else "send")
            elif a.kind is W:
                assert (p.source, p.sink, p.key) == ("", "", None)
            else:
                assert p.source == ("" if a.stage == last else "local" if dev[a.stage + 1] == me else "recv")
                assert p.sink == ("" if a.stage == 0 else "local" if dev[a.stage - 1] == me else "send")
