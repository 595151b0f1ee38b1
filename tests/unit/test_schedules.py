"""Generators, the text form and validation errors (no timing here: see test_simulator.py)."""

import pickle

import pytest

from modelpar.schedules import (
    Action,
    Kind,
    Schedule,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    naive,
    one_f_one_b,
    schedule_names,
    schedule_table,
    validate_schedule,
    zb_h1,
)
from modelpar.schedules.registry import schedule_entry


def line(schedule, device):
    return " ".join(map(str, schedule.actions[device]))


def test_gpipe_order_is_all_forwards_then_backwards_last_first():
    assert line(gpipe(ranks=4, microbatches=3), 2) == "2F0 2F1 2F2 2B2 2B1 2B0"


def test_1f1b_order_matches_reference_chart_device_0():
    # §4.1: F0F1F2F3 ... B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7
    assert line(one_f_one_b(ranks=4, microbatches=8), 0) == "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7"
    assert line(one_f_one_b(ranks=4, microbatches=8), 3) == " ".join(f"3F{j} 3B{j}" for j in range(8))


def test_1f1b_with_fewer_microbatches_than_stages_is_still_valid():
    s = one_f_one_b(ranks=5, microbatches=2)
    validate_schedule(s)
    assert line(s, 0) == "0F0 0F1 0B0 0B1"  # warm-up capped at M


def test_naive_is_one_microbatch_at_a_time():
    assert naive(ranks=3).actions == ((Action(0, Kind.F, 0), Action(0, Kind.B, 0)),
                                (Action(1, Kind.F, 0), Action(1, Kind.B, 0)),
                                (Action(2, Kind.F, 0), Action(2, Kind.B, 0)))
    assert line(naive(ranks=2, microbatches=2), 1) == "1F0 1B0 1F1 1B1"


def test_interleaved_loop_map_and_megatron_warmup():
    s = interleaved_1f1b(ranks=4, microbatches=8, chunks=2)
    assert s.stage_to_rank == (0, 1, 2, 3, 0, 1, 2, 3)
    assert s.stages_on(1) == [1, 5]
    assert s.chunks == 2
    # device 0: 2(K - 1) + (v - 1)K = 10 warm-up chunk-forwards, groups of K per chunk
    assert line(s, 0).split()[:12] == "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4B0".split()
    assert interleaved_1f1b(ranks=4, microbatches=8, chunks=1).actions == one_f_one_b(ranks=4, microbatches=8).actions


def _megatron_interleaved(k, m, v):
    """Interleaved 1F1B written step by step, as Megatron's schedule reads (the generator's spec)."""
    def at(step, kind, d):
        chunk = (step // k) % v
        return Action((v - 1 - chunk if kind is Kind.B else chunk) * k + d, kind, (step // (k * v)) * k + step % k)

    out = []
    for d in range(k):
        total, warm = m * v, min(2 * (k - d - 1) + (v - 1) * k, m * v)
        acts = [at(j, Kind.F, d) for j in range(warm)]
        for j in range(total - warm):
            acts += [at(warm + j, Kind.F, d), at(j, Kind.B, d)]
        out.append(tuple(acts + [at(j, Kind.B, d) for j in range(total - warm, total)]))
    return tuple(out)


@pytest.mark.parametrize("k, v", [(1, 2), (2, 2), (3, 3), (4, 2), (4, 4), (5, 3)])
def test_interleaved_matches_the_step_by_step_definition(k, v):
    for m in (k, 2 * k, 5 * k):
        assert interleaved_1f1b(ranks=k, microbatches=m, chunks=v).actions == _megatron_interleaved(k, m, v)


def test_action_is_a_cheap_immutable_named_tuple():
    a = Action(2, Kind.B, 5)
    assert isinstance(a, tuple) and a == (2, Kind.B, 5) and hash(a) == hash((2, Kind.B, 5))
    stage, kind, microbatch = a
    assert (stage, kind, microbatch) == (a.stage, a.kind, a.microbatch) == (2, Kind.B, 5)
    assert str(a) == "2B5" and Action.parse(" 2B5 ") == a and repr(a) == "Action(stage=2, kind=<Kind.B: 'B'>, microbatch=5)"
    assert sorted([Action(1, Kind.F, 0), Action(0, Kind.W, 3), Action(1, Kind.B, 1)]) == [
        Action(0, Kind.W, 3), Action(1, Kind.B, 1), Action(1, Kind.F, 0)]
    assert pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(AttributeError):
        a.stage = 3


def test_zb_h1_splits_backward_and_defers_w_by_device_index():
    s = zb_h1(ranks=4, microbatches=6)
    assert s.split_backward
    assert line(s, 0) == "0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0I3 0W3 0I4 0W4 0I5 0W5"
    assert line(s, 3) == "3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3W3 3W4 3W5"


@pytest.mark.parametrize("name", schedule_names())
def test_get_schedule_names(name):
    s = get_schedule(name, ranks=4, microbatches=8, chunks=schedule_entry(name).default_chunks)
    assert s.name == name
    assert s.num_ranks == 4 and s.num_microbatches == 8
    validate_schedule(s)


@pytest.mark.parametrize("name", schedule_names())
def test_each_registry_entry_states_what_its_generator_builds(name):
    """The entry's microbatch rule is the generator's (it builds exactly the M the rule allows), and its chunks and
    split-backward flag are the built schedule's."""
    entry = schedule_entry(name)
    v = entry.default_chunks
    for k in (1, 2, 3):
        for m in range(1, 7):
            if entry.microbatches.allows(m, k, v):
                s = get_schedule(name, ranks=k, microbatches=m, chunks=v)
                assert (s.chunks, s.split_backward) == (v, entry.split_backward)
            else:
                with pytest.raises(ValueError, match=rf"microbatches .*(got {m}|\({m}\))"):
                    get_schedule(name, ranks=k, microbatches=m, chunks=v)
    assert entry.trains == (name != "naive")


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: get_schedule("pipedream", ranks=4, microbatches=8),
         r"schedule must be one of \{naive, gpipe, 1f1b, interleaved, looped-bfs, zb-h1, zb-h2, zb-v, v-half, "
         r"v-min, dualpipe-v, dualpipe-v-serial\}, got 'pipedream'"),
        (lambda: get_schedule("zb-v", ranks=4, microbatches=8, chunks=3), r"chunks must be 2 for schedule 'zb-v'"),
        (lambda: get_schedule("dualpipe-v", ranks=4, microbatches=7),
         r"microbatches must be >= 8, got 7 \(schedule 'dualpipe-v' needs 2 x ranks\)"),
        (lambda: get_schedule("gpipe", ranks=0, microbatches=8), r"ranks must be >= 1, got 0"),
        (lambda: get_schedule("1f1b", ranks=4, microbatches=-2), r"microbatches must be >= 1, got -2"),
        (lambda: get_schedule("gpipe", ranks=2.5, microbatches=8), r"ranks must be an integer, got 2.5"),
        (lambda: get_schedule("interleaved", ranks=4, microbatches=6, chunks=2),
         r"microbatches \(6\) must be divisible by ranks \(4\)"),
        (lambda: get_schedule("interleaved", ranks=4, microbatches=8, chunks=0), r"chunks must be >= 1, got 0"),
        (lambda: get_schedule("gpipe", ranks=4, microbatches=8, chunks=2), r"chunks must be 1 for schedule 'gpipe'.*got 2"),
        (lambda: zb_h1(ranks=4, microbatches=0), r"microbatches must be >= 1, got 0"),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_text_form_round_trip_and_device_prefix():
    s = one_f_one_b(ranks=3, microbatches=4)
    assert Schedule.from_text(s.to_text()).actions == s.actions
    parsed = Schedule.from_text("# comment\ndevice 0: 0F0 0B0\n\ndevice 1: 1F0, 1B0  # tail\n")  # rename: keep
    assert parsed.stage_to_rank == (0, 1)
    assert str(parsed) == "0F0 0B0\n1F0 1B0"


@pytest.mark.parametrize(
    "text, match",
    [
        ("0F0 0B0\n1B0 1F0", r"rank 1 runs 1B0 \(position 0\) before its dependency 1F0 \(position 1\)"),
        ("0F0 0F1 0B0 0B1\n1F0 1B0", r"action 1F1 is missing \(rank 1\)"),
        ("0F0 0F0 0B0\n1F0 1B0", r"action 0F0 appears twice \(rank 0 position 0, rank 0 position 1\)"),
        ("0F0 0I0 0W0\n1F0 1B0", r"action 1B0 \(rank 1, position 1\) is a full backward B, but the schedule splits"),
        ("0F0 0I0\n1F0 1I0 1W0", r"action 0W0 is missing"),
        (
            "0F0 0B0 0F1 0B1\n1F1 1F0 1B0 1B1",
            r"deadlock: rank 0 waits at 0B0 \(position 1\) for 1B0 on rank 1; rank 1 waits at 1F1 "
            r"\(position 0\) for 0F1 on rank 0",
        ),
        ("0F0 0B0\n0F1", r"stage 0 appears on rank 0 and rank 1"),
        ("0F0 0X0", r"action must look like <stage><F\|B\|I\|W><microbatch>"),
        ("", r"at least one rank"),
    ],
)
def test_validation_names_the_first_offending_action(text, match):
    with pytest.raises(ValueError, match=match):
        Schedule.from_text(text, name="hand").validate()


def test_action_on_the_wrong_device():
    s = Schedule((1, 0), [[Action(0, Kind.F, 0), Action(0, Kind.B, 0)], [Action(1, Kind.F, 0), Action(1, Kind.B, 0)]])
    with pytest.raises(ValueError, match=r"action 0F0 is in rank 0's list \(position 0\), but stage 0 lives on rank 1"):
        s.validate()


def test_schedule_table_places_actions_at_their_first_possible_step():
    assert schedule_table(one_f_one_b(ranks=2, microbatches=2)).splitlines() == [
        "Step  Device 0  Device 1",
        "   0  0F0",
        "   1  0F1       1F0",
        "   2            1B0",
        "   3  0B0       1F1",
        "   4            1B1",
        "   5  0B1",
    ]
