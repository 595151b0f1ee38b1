"""Message order between devices: what NCCL (which ignores tags) needs from a schedule."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelpar.schedules import Schedule, check_fifo_order, get_schedule, pair_messages


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1"]), k=st.integers(1, 6),
       mult=st.integers(1, 4), extra=st.integers(0, 3), v=st.integers(2, 3))
def test_generated_schedules_send_in_the_order_they_are_consumed(name, k, mult, extra, v):
    m = k * mult if name == "interleaved" else k * mult + extra
    schedule = get_schedule(name, k, m, chunks=v if name == "interleaved" else 1)
    sent, recv = pair_messages(schedule)
    assert sent == recv
    check_fifo_order(schedule)


def test_message_lists_hand_checked_for_gpipe_2x2():
    sent, recv = pair_messages(get_schedule("gpipe", 2, 2))
    assert sent == recv == {(0, 1): [("act", 1, 0), ("act", 1, 1)], (1, 0): [("grad", 1, 1), ("grad", 1, 0)]}


def test_out_of_order_consumption_is_named():
    # Valid with tags (gloo), but device 1 wants microbatch 1's activation first.
    s = Schedule.from_text("0F0 0F1 0B0 0B1\n1F1 1F0 1B0 1B1").validate()
    with pytest.raises(ValueError, match=r"device 0 sends the activation entering stage 1 for "
                       r"microbatch 0 as its message #0 to device 1, which expects the activation "
                       r"entering stage 1 for microbatch 1"):
        check_fifo_order(s)
