"""DualPipe's overlapped F&B pairs as data: the pair rule, text and CSV forms, validation, lowering, pricing."""

import pytest

from modelpar.schedules import Schedule, get_schedule
from modelpar.schedules.lower import Transfer, lower, rendezvous
from modelpar.schedules.overlap import pair_time
from modelpar.schedules.torch_csv import from_csv, to_csv
from modelpar.simulate import Costs, simulate

ONE_RANK = "0F0 1F0 1B0 (0F1;0B0)OVERLAP_F_B 1F1 1B1 0B1"  # a V on one rank (stages 0, 1), one pair


def test_pair_time_hides_each_halfs_communication_behind_the_others_compute():
    assert pair_time(1.0, 0.0, 2.0, 0.0) == 3.0  # nothing to hide: back to back
    assert pair_time(1.0, 0.4, 2.0, 0.6) == pytest.approx(2.0)  # compute 0.6 + 1.4 bounds it
    assert pair_time(1.0, 0.9, 1.0, 0.9) == pytest.approx(1.8)  # the links bound it: 0.9 + 0.9
    assert pair_time(3.0, 0.5, 0.2, 0.0) == 3.0  # the forward's own compute and communication bound it


def test_text_form_round_trips_and_marks_the_pair():
    s = Schedule.from_text(ONE_RANK)
    assert s.overlapped == ((3,),) and s.has_overlap and s.stage_to_rank == (0, 0)
    assert s.to_text() == ONE_RANK and Schedule.from_text(s.to_text()) == s
    d = get_schedule("dualpipe-v", ranks=4, microbatches=10)
    assert Schedule.from_text(d.to_text(), name="dualpipe-v") == d
    assert d.actions == get_schedule("dualpipe-v-serial", ranks=4, microbatches=10).actions


def test_csv_writes_a_pairs_full_backward_as_torch_does():
    d = get_schedule("dualpipe-v", ranks=2, microbatches=4)
    text = to_csv(d)
    assert "(0F3;3B1)OVERLAP_F_B" in text.splitlines()[0]  # the I and its W behind it: torch's full backward
    assert from_csv(text, "dualpipe-v") == d
    comms = to_csv(d, comm=True)
    assert comms.count("OVERLAP_F_B") == sum(map(len, d.overlapped))


@pytest.mark.parametrize("text, match", [
    ("0F0 1F0 (1B0;0F1)OVERLAP_F_B 1F1 1B1 0B1 0B0", r"a pair is a forward F followed by a backward \(B or I\)"),
    ("0F0 (1F0;1B0)OVERLAP_F_B 0B0", r"pair \(1F0;1B0\)OVERLAP_F_B on rank 0: its backward needs its forward's output"),
])
def test_bad_pairs_are_refused_in_one_line(text, match):
    with pytest.raises(ValueError, match=match):
        Schedule.from_text(text)


def test_overlapped_must_fit_the_ranks():
    s = Schedule.from_text(ONE_RANK)
    with pytest.raises(ValueError, match=r"overlapped must hold one tuple per rank \(1\), got 2"):
        Schedule(s.stage_to_rank, s.actions, "", ((3,), ()))
    with pytest.raises(ValueError, match="share an action"):
        Schedule(s.stage_to_rank, s.actions, "", ((3, 4),))


def test_a_pair_is_priced_with_its_communication_hidden():
    """Hand-checked: F = 0.5 (0.2 of it communication), B = 1 (0.4) per stage of the one-rank V; the pair
    takes max(0.3 + 0.6, 0.2 + 0.4, 0.5, 1) = 1 instead of 1.5, drawn as F then B in proportion 1 : 2."""
    s = Schedule.from_text(ONE_RANK)
    costs = Costs(forward=1.0, backward=2.0, forward_comm=0.4, backward_comm=0.8)
    tl = simulate(s, costs)
    assert tl.starts[0] == pytest.approx([0, 0.5, 1, 2, 2 + 1 / 3, 3, 3.5, 4.5])
    assert tl.ends[0] == pytest.approx([0.5, 1, 2, 2 + 1 / 3, 3, 3.5, 4.5, 5.5])
    serial = Schedule(s.stage_to_rank, s.actions)
    assert simulate(serial, costs).step_time == pytest.approx(6.0)


@pytest.mark.parametrize("k, m", [(1, 2), (2, 4), (2, 7), (4, 8), (4, 16), (8, 16)])
def test_overlap_never_slower_and_equal_without_communication(k, m):
    on, off = (get_schedule(n, ranks=k, microbatches=m) for n in ("dualpipe-v", "dualpipe-v-serial"))
    for weight in (1.0, 0.8):
        plain = Costs(forward=1.0, backward=2.0, weight=weight)
        assert simulate(on, plain).starts == simulate(off, plain).starts  # no communication: the same timeline
        moe = Costs(forward=1.0, backward=2.0, weight=weight, forward_comm=0.4, backward_comm=0.4, transfer=0.3)
        assert simulate(on, moe).step_time < simulate(off, moe).step_time


@pytest.mark.parametrize("k, m", [(1, 2), (2, 5), (4, 9)])
def test_a_pair_is_lowered_as_a_unit(k, m):
    s = get_schedule("dualpipe-v", ranks=k, microbatches=m)
    programs = lower(s)
    for d, program in enumerate(programs):
        acts = s.actions[d]
        for i in s.overlapped[d]:
            f, j = acts[i], program.index(acts[i])
            assert program[j + 1] == acts[i + 1]  # the two halves back to back ...
            sends = [n for n, op in enumerate(program) if isinstance(op, Transfer) and op.is_send
                     and op.message == ("F", f.stage, f.microbatch)]
            assert all(n > j + 1 for n in sends)  # ... the forward's output sent after both
    assert rendezvous(programs, s.stage_to_rank) is None
    assert rendezvous(programs, s.stage_to_rank, channel="rank") is None


def test_the_cost_model_hides_the_expert_all_to_alls_in_pairs_on_a_gpu_only():
    import dataclasses

    from modelpar.costmodel.local import predict_local
    from modelpar.costmodel.presets import CPU_DEFAULT
    from modelpar.model import ModelConfig
    from modelpar.training import TrainConfig
    from modelpar.training.prediction import local_run

    moe = ModelConfig(arch="llama", hidden=64, heads=4, layers=4, seq_len=64, experts=4, top_k=2)
    gpu = dataclasses.replace(CPU_DEFAULT, device="cuda")
    step = {}
    for name in ("dualpipe-v", "dualpipe-v-serial"):
        cfg = TrainConfig(model=moe, tp=1, pp=1, dp=2, ep=2, schedule=name, chunks=2, microbatches=4, batch_size=16)
        step[name] = [predict_local(local_run(cfg.check(2)), hw).step_time_s for hw in (CPU_DEFAULT, gpu)]
    assert step["dualpipe-v"][0] == step["dualpipe-v-serial"][0]  # a CPU runs a pair's halves one after the other
    assert step["dualpipe-v"][1] < step["dualpipe-v-serial"][1]
