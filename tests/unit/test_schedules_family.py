"""The schedules beyond 1F1B: Looped BFS, ZB-H2, ZB-V, V-Half, V-Min, DualPipe-V.

Orders against torch.distributed.pipelining's classes (their private per-rank generators, called
on a stand-in object: no processes), the papers' memory and bubble claims with the simulator,
and validity plus the rendezvous model over K and M.
"""

import math
from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from modelpar.schedules import Action, Kind, get_schedule, lower, schedule_names
from modelpar.schedules.lower import rendezvous
from modelpar.schedules.registry import schedule_entry
from modelpar.simulate import Costs, simulate

NEW = ["looped-bfs", "zb-h2", "zb-v", "v-half", "v-min", "dualpipe-v"]
EQUAL = Costs(forward=1, backward=2, weight=1)  # T_F = T_I = T_W


def _torch_order(cls, k, m, chunks=2):
    """torch's pipeline_order for K ranks, flattened: None dropped, OVERLAP_F_B expanded, B -> I W."""
    fake = SimpleNamespace(pp_group_size=k, num_stages=chunks * k, _num_stages=chunks * k, _n_microbatches=m,
                           _stages=[None] * chunks)
    out = []
    for rank in range(k):
        acts = []
        for a in cls._calculate_single_rank_operations(fake, rank):
            for sub in (a.sub_actions or (a,)) if a is not None else ():
                kind = Kind(sub.computation_type.value)
                if kind is Kind.B and cls is not torch_schedules.ScheduleLoopedBFS:
                    acts += [Action(sub.stage_index, Kind.I, sub.microbatch_index),
                             Action(sub.stage_index, Kind.W, sub.microbatch_index)]
                else:
                    acts.append(Action(sub.stage_index, kind, sub.microbatch_index))
        out.append(tuple(acts))
    return tuple(out)


@pytest.mark.parametrize("name, cls, ms", [
    ("looped-bfs", torch_schedules.ScheduleLoopedBFS, lambda k: (1, 3, k, 2 * k + 1)),
    ("zb-v", torch_schedules.ScheduleZBVZeroBubble, lambda k: (1, 2, k, 2 * k - 1, 2 * k, 3 * k + 1)),
    ("dualpipe-v", torch_schedules.ScheduleDualPipeV, lambda k: (2 * k, 2 * k + 1, 3 * k)),
])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_orders_equal_torchs(name, cls, ms, k):
    for m in ms(k):
        ours = get_schedule(name, ranks=k, microbatches=m, chunks=schedule_entry(name).default_chunks)
        assert ours.actions == _torch_order(cls, k, m), (name, k, m)


@pytest.mark.parametrize("name", NEW)
def test_valid_and_lowered_programs_pass_the_rendezvous_model(name):
    for k in range(1, 7):
        for m in range(1, 13):
            if name.startswith("dualpipe-v") and m < 2 * k:
                continue
            s = get_schedule(name, ranks=k, microbatches=m, chunks=schedule_entry(name).default_chunks).validate()
            assert s.name == name and s.num_microbatches == m and s.num_ranks == k
            programs = lower(s)
            assert rendezvous(programs, s.stage_to_rank) is None
            assert rendezvous(programs, s.stage_to_rank, channel="rank") is None


def test_v_placement_and_registry():
    assert get_schedule("zb-v", ranks=3, microbatches=4).stage_to_rank == (0, 1, 2, 2, 1, 0)
    assert get_schedule("looped-bfs", ranks=2, microbatches=2, chunks=3).stage_to_rank == (0, 1, 0, 1, 0, 1)
    assert set(NEW) <= set(schedule_names())


@pytest.mark.parametrize("k", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("costs", [EQUAL, Costs(forward=1, backward=1.5, weight=0.5)])
def test_zb_h2_only_the_fill_is_idle_with_2k_minus_1_in_flight(k, costs):
    """Qi et al. 2024a §3.1: ZB-H2 holds up to 2K − 1 microbatches (counted until W) on each rank and
    leaves only the (K − 1)T_F fill idle: step (K − 1)T_F + M(T_F + T_B + T_W), less than ZB-H1's
    M(T_F + T_B + T_W) + (K − 1)(T_F + T_B − T_W) whenever T_B > T_W."""
    times = {Kind.F: costs.forward, Kind.I: costs.full_backward - costs.weight_grad, Kind.W: costs.weight_grad}
    for m in (2 * k, 4 * k):
        tl = simulate(get_schedule("zb-h2", ranks=k, microbatches=m, costs=times), costs)
        assert tl.step_time == pytest.approx((k - 1) * costs.forward + m * (costs.forward + costs.full_backward))
        assert tl.peak_held == [2 * k - 1] * k
        h1 = simulate(get_schedule("zb-h1", ranks=k, microbatches=m), costs)
        assert tl.step_time <= h1.step_time


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6, 8, 12])  # K = 16 held too when run by hand (20 s of the suite)
def test_controllable_memory_claims(k):
    """Qi et al. 2024b: V-Min holds about 1/3 of 1F1B's activations, V-Half about 1/2, both with
    a step no longer than 1F1B's (equal F, I and W); ZB-V holds as much as 1F1B's first rank,
    on every rank, and (M ≥ 2K) has the shortest step of the V family, shorter than ZB-H1's."""
    for m in (k, 2 * k, 4 * k):
        one = simulate(get_schedule("1f1b", ranks=k, microbatches=m), EQUAL)
        vmin = simulate(get_schedule("v-min", ranks=k, microbatches=m), EQUAL)
        vhalf = simulate(get_schedule("v-half", ranks=k, microbatches=m), EQUAL)
        zbv = simulate(get_schedule("zb-v", ranks=k, microbatches=m), EQUAL)
        assert max(vmin.peak_held) <= math.ceil((k + 2) / 3)
        assert max(vhalf.peak_held) <= math.ceil((k + 2) / 2)
        assert vmin.step_time <= one.step_time and vhalf.step_time <= vmin.step_time
        assert max(zbv.peak_held) <= k
        if m >= 2 * k:  # ZB-V is planned for at least 2K − 1 microbatches
            assert zbv.step_time <= vhalf.step_time
            assert zbv.step_time < simulate(get_schedule("zb-h1", ranks=k, microbatches=m), EQUAL).step_time


def test_looped_bfs_holds_every_microbatch_like_gpipe():
    tl = simulate(get_schedule("looped-bfs", ranks=4, microbatches=8, chunks=2))
    assert tl.peak_held == [8, 8, 8, 8]
    assert tl.transfers == simulate(get_schedule("interleaved", ranks=4, microbatches=8, chunks=2)).transfers


@pytest.mark.parametrize("costs", [EQUAL, Costs(forward=1, backward=2, weight=0.5), Costs(forward=2, backward=3, weight=1)])
def test_looped_bfs_closed_form(costs):
    """M ≥ K: (vM + K − 1)(T_F + T_B)/v — GPipe's fill and drain, paid once across the v chunks."""
    for k in (1, 2, 3, 4, 6):
        for m in range(k, 3 * k + 2):
            for v in (1, 2, 3):
                tl = simulate(get_schedule("looped-bfs", ranks=k, microbatches=m, chunks=v), costs)
                assert tl.step_time == pytest.approx((v * m + k - 1) * (costs.forward + costs.full_backward) / v)


@pytest.mark.parametrize("name", ["zb-v", "dualpipe-v"])
def test_zb_v_and_dualpipe_v_closed_form_with_equal_times(name):
    """T_F = T_I = T_W, M ≥ 2K: step 3M·T_F + (K − 1)T_F/2 — the only idle time is a chunk's
    forward per hop of the fill (a chunk is half a stage)."""
    for k in range(1, 9):
        for m in (2 * k, 2 * k + 1, 3 * k, 4 * k):
            tl = simulate(get_schedule(name, ranks=k, microbatches=m), EQUAL)
            assert tl.step_time == pytest.approx(3 * m + (k - 1) / 2)
