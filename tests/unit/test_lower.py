"""Lowering (pure Python): per-pair order identical at both ends, receive before use, no hang on NCCL."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelpar.schedules import Action, DeadlockError, Kind, Schedule, get_schedule, lower, schedule_names
from modelpar.schedules.derive import forward_only, on_one_rank
from modelpar.schedules.lower import Comm, Transfer, parse_op, rendezvous

SETTINGS = settings(max_examples=80, deadline=None)


@st.composite
def generated(draw):
    name = draw(st.sampled_from(schedule_names()))
    k = draw(st.integers(1, 6))
    if name == "interleaved":
        return get_schedule(name, ranks=k, microbatches=k * draw(st.integers(1, 3)), chunks=draw(st.integers(1, 4)))
    if name == "looped-bfs":
        return get_schedule(name, ranks=k, microbatches=draw(st.integers(1, 9)), chunks=draw(st.integers(1, 4)))
    low = 2 * k if name.startswith("dualpipe-v") else 1
    return get_schedule(name, ranks=k, microbatches=draw(st.integers(low, max(low, 9))))


@st.composite
def hand_written(draw):
    """A random valid schedule: a random placement (contiguous, loop, V or any) and a random
    interleaving of the dependency graph, cut into per-rank lists."""
    devices = draw(st.integers(1, 4))
    chunks = draw(st.integers(1, 3))
    stages = devices * chunks
    shape = draw(st.sampled_from(["contiguous", "loop", "v", "any"]))
    if shape == "loop":
        placement = [s % devices for s in range(stages)]
    elif shape == "v":  # down and back up: device d holds d, 2K-1-d, 2K+d, ...
        placement = [s % devices if (s // devices) % 2 == 0 else devices - 1 - s % devices for s in range(stages)]
    elif shape == "any":
        placement = draw(st.lists(st.integers(0, devices - 1), min_size=stages, max_size=stages))
        placement[: devices] = range(devices) if stages >= devices else placement[: devices]
    else:
        placement = sorted(s * devices // stages for s in range(stages))
    used = sorted(set(placement))
    placement = [used.index(d) for d in placement]  # no device without a stage
    microbatches = draw(st.integers(1, 4))
    kinds = draw(st.sampled_from([(Kind.F, Kind.B), (Kind.F, Kind.I, Kind.W), (Kind.F,)]))
    todo = [Action(s, k, m) for s in range(stages) for m in range(microbatches) for k in kinds]
    probe = Schedule(tuple(placement), tuple(() for _ in used))
    done, order, rng = set(), [], random.Random(draw(st.integers(0, 2**32)))
    while todo:
        ready = [a for a in todo if all(dep in done for dep in _deps(probe, a, kinds))]
        a = rng.choice(ready)
        todo.remove(a)
        done.add(a)
        order.append(a)
    per_rank = [[a for a in order if placement[a.stage] == d] for d in range(len(used))]
    return Schedule(tuple(placement), tuple(map(tuple, per_rank)), f"random-{shape}")


def _deps(schedule, a, kinds):
    if kinds == (Kind.F,):
        return [Action(a.stage - 1, Kind.F, a.microbatch)] if a.stage else []
    grad = Kind.I if Kind.I in kinds else Kind.B
    if a.kind is Kind.W:
        return [Action(a.stage, Kind.I, a.microbatch)]
    if a.kind is Kind.F:
        return [Action(a.stage - 1, Kind.F, a.microbatch)] if a.stage else []
    deps = [Action(a.stage, Kind.F, a.microbatch)]
    if a.stage < schedule.num_stages - 1:
        deps.append(Action(a.stage + 1, grad, a.microbatch))
    return deps


def _pair_messages(programs, placement, d, e):
    """What rank d posts on its channel with e, as (message, is_send), in program order."""
    return [(op.message, op.is_send) for op in programs[d]
            if isinstance(op, Transfer) and placement[op.peer_stage] == e]


def check_lowering(schedule):
    programs = lower(schedule)
    placement = schedule.stage_to_rank
    for d, program in enumerate(programs):
        # the compute actions are the schedule's, in its order
        assert [op for op in program if isinstance(op, Action)] == list(schedule.actions[d])
        position = {op: i for i, op in enumerate(program)}
        acts = schedule.actions[d]
        partner = {acts[j]: acts[j + 1] for j in schedule.overlapped[d]}  # a pair's forward sends after its backward
        for i, op in enumerate(program):
            if not isinstance(op, Transfer):
                continue
            peer = placement[op.peer_stage]
            assert peer != d, f"{op}: stages on one rank hand over in memory, no message"
            assert placement[op.stage] == d
            kind, producer, m = op.message
            if op.is_send:  # right after its producer (sends of one action follow it in a row)
                made = Action(producer, Kind.F if kind == "F" else _grad_kind(schedule), m)
                after = partner.get(made, made)
                assert position[made] < i and all(isinstance(x, Transfer) and x.is_send
                                                  for x in program[position[after] + 1:i])
            else:  # before the action that consumes it
                consumer = Action(op.stage, Kind.F, m) if kind == "F" else Action(op.stage, _grad_kind(schedule), m)
                assert i < position[consumer]
    # per pair: the same messages in the same order at both ends, send and receive swapped
    pairs = 0
    for d in range(len(programs)):
        for e in range(d + 1, len(programs)):
            mine, theirs = _pair_messages(programs, placement, d, e), _pair_messages(programs, placement, e, d)
            assert [m for m, _ in mine] == [m for m, _ in theirs]
            assert all(a != b for (_, a), (_, b) in zip(mine, theirs))
            pairs += len(mine)
    crossing = sum(placement[s] != placement[s - 1] for s in range(1, len(placement)))
    per_boundary = 1 if schedule.forward_only else 2
    assert pairs == per_boundary * crossing * schedule.num_microbatches  # one message per cross-device dependency
    assert rendezvous(programs, placement) is None  # one channel per pair: NCCL's single isend/irecv
    assert rendezvous(programs, placement, channel="rank") is None  # one per device: batched P2P's stream
    return programs


def _grad_kind(schedule):
    return Kind.I if schedule.split_backward else Kind.B


@SETTINGS
@given(generated())
def test_every_generated_schedule_lowers_to_matched_programs(schedule):
    check_lowering(schedule)


@SETTINGS
@given(hand_written())
def test_random_hand_written_schedules_lower_to_matched_programs(schedule):
    check_lowering(schedule)


@settings(max_examples=30, deadline=None)
@given(generated())
def test_forward_only_and_one_device_schedules(schedule):
    fwd = forward_only(schedule)
    assert fwd.forward_only and fwd.stage_to_rank == schedule.stage_to_rank
    assert [[a for a in acts if a.kind is Kind.F] for acts in schedule.actions] == [list(a) for a in fwd.actions]
    check_lowering(fwd)
    one = on_one_rank(schedule)
    assert sorted(one.actions[0]) == sorted(a for acts in schedule.actions for a in acts)
    assert lower(one) == one.actions  # one device: no messages at all


def test_reference_1f1b_program():
    programs = lower(get_schedule("1f1b", ranks=2, microbatches=2))
    assert [" ".join(map(str, p)) for p in programs] == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0RECV_B1 0B0 0B1",
        "1RECV_F0 1RECV_F1 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1",
    ]


def _tag_matched_posting_order(schedule, lookahead=3):
    """The order the tag-matched executor posted in: receives ``lookahead`` actions ahead, sends
    right after their producer."""
    dev, last = schedule.stage_to_rank, schedule.num_stages - 1

    def recv_of(a):
        if a.kind is Kind.F and a.stage > 0 and dev[a.stage - 1] != dev[a.stage]:
            return Transfer(a.stage, Comm.RECV_F, a.microbatch)
        if a.kind in (Kind.B, Kind.I) and a.stage < last and dev[a.stage + 1] != dev[a.stage]:
            return Transfer(a.stage, Comm.RECV_B, a.microbatch)
        return None

    programs = []
    for acts in schedule.actions:
        program, nxt, posted = [], 0, set()
        for i, a in enumerate(acts):
            while nxt < len(acts) and (nxt <= i or len(posted) < lookahead):
                if recv_of(acts[nxt]) is not None:
                    program.append(recv_of(acts[nxt]))
                    posted.add(nxt)
                nxt += 1
            posted.discard(i)
            program.append(a)
            if a.kind is Kind.F and a.stage < last and dev[a.stage + 1] != dev[a.stage]:
                program.append(Transfer(a.stage, Comm.SEND_F, a.microbatch))
            if a.kind in (Kind.B, Kind.I) and a.stage > 0 and dev[a.stage - 1] != dev[a.stage]:
                program.append(Transfer(a.stage, Comm.SEND_B, a.microbatch))
        programs.append(program)
    return programs


def test_tag_matched_posting_order_hangs_under_ordered_matching():
    schedule = get_schedule("1f1b", ranks=2, microbatches=2)
    old = _tag_matched_posting_order(schedule)
    assert [" ".join(map(str, p)) for p in old] == [
        "0RECV_B0 0RECV_B1 0F0 0SEND_F0 0F1 0SEND_F1 0B0 0B1",
        "1RECV_F0 1RECV_F1 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1",
    ]
    assert rendezvous(old, schedule.stage_to_rank) == (
        "rank 1's 1RECV_F0 (position 0) would be paired with rank 0's 0RECV_B0 (position 0): "
        "the next operation between them is not one message's send and receive"
    )
    assert rendezvous(lower(schedule), schedule.stage_to_rank) is None


def test_rendezvous_names_what_never_comes():
    schedule = get_schedule("gpipe", ranks=2, microbatches=1)
    programs = [list(p) for p in lower(schedule)]
    programs[0].remove(Transfer(0, Comm.SEND_F, 0))  # the activation is never sent ...
    programs[1].remove(Transfer(1, Comm.RECV_F, 0))  # ... nor received
    assert rendezvous(programs, schedule.stage_to_rank) == (
        "rank 0 never gets past 0B0 (position 2): it waits for the gradient of microbatch 0 from "
        "stage 1, which never comes"
    )


def test_a_schedule_that_would_hang_is_refused_naming_the_operation():
    hang = Schedule.from_text("0F0 0B0 0F1 0B1\n1F0 1F1 1B0 1B1", name="mine")
    with pytest.raises(DeadlockError, match=(
        r"cannot lower schedule 'mine': it would hang: rank 0 waits at 0RECV_B0 \(the input of 0B0\), "
        r"but rank 1 never reaches 1SEND_B0; rank 1 waits at 1RECV_F1 \(the input of 1F1\), but "
        r"rank 0 never reaches 0SEND_F1")):
        lower(hang)
    with pytest.raises(ValueError, match=r"action 1F1 is missing"):
        lower(Schedule.from_text("0F0 0F1 0B0 0B1\n1F0 1B0"))


@pytest.mark.parametrize("text", ["0F3", "12B0", "2I1", "0W7", "0SEND_F3", "1RECV_F3", "1SEND_B3", "0RECV_B3"])
def test_operation_text_round_trips(text):
    assert str(parse_op(text)) == text


def test_bad_operation_text():
    with pytest.raises(ValueError, match=r"operation must look like .* got '0SEND3'"):
        parse_op("0SEND3")
