"""The local cost model's structure (pure Python, hand-checked): ZeRO-2/3's collectives, the busy pair fits,
core sharing, context parallelism's activations, gradient group and key/value traffic. The trainer's own bytes
are checked against the same functions in test_prediction."""

import dataclasses

import pytest

from modelpar.costmodel.inventory import stage_buckets, stage_tensors
from modelpar.costmodel.local import (
    _comm,
    all_reduce_exposed,
    core_share,
    cp_layer_seconds,
    dp_bytes_step,
    dp_traffic,
    predict_local,
    stage_costs,
)
from modelpar.costmodel.local_memory import LocalLayout, activation_bytes, batch_view_bytes, state_bytes
from modelpar.costmodel.local_search import Capabilities, layouts
from modelpar.costmodel.moe import MoESpec, moe_layer_params
from modelpar.costmodel.presets import CPU_DEFAULT
from modelpar.costmodel.profiles import HardwareProfile
from modelpar.costmodel.specs import ModelSpec
from modelpar.costmodel.zero_bytes import dp_bytes_sent
from modelpar.formulas import allreduce_bytes
from modelpar.model import ModelConfig

TINY = ModelConfig(hidden=32, heads=4, layers=4, seq_len=16).spec()
RUN = LocalLayout(TINY, d=4, microbatches=2, batch=16, precision="fp64")  # one stage, one bucket
LATENCY, GBPS = 1e-4, 1.0  # CPU_DEFAULT's fit of every collective


def _time(nbytes: float) -> float:
    return LATENCY + nbytes / (GBPS * 1e9)


@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("d", [2, 3, 4])
def test_one_bucket_sends_what_the_zero_formulas_say(zero, reshard, d):
    """One bucket holding every parameter is the flat buffer costmodel.zero_bytes pads once: equal bytes."""
    run = dataclasses.replace(RUN, zero=zero, reshard=reshard, d=d)
    params = sum(x.numel for x in stage_tensors(run, 0))
    assert dp_bytes_step(run, [0]) == dp_bytes_sent(params, d, zero, 8, 8, run.microbatches, reshard)


def test_zero3_gathers_in_the_compute_dtype_and_keeps_ranges():
    run = dataclasses.replace(RUN, zero=3, precision="bf16", d=4)
    params = sum(x.numel for x in stage_tensors(run, 0))
    shard = -(-params // 4)
    scatter, gather, after = dp_traffic(run, 0)
    assert (scatter, gather, after) == ([3 * shard * 4], [3 * shard * 2], [])  # fp32 gradients, bf16 gathers
    assert state_bytes(run, [0])["parameters"] == shard * 4  # the fp32 master range
    assert dp_traffic(dataclasses.replace(run, zero=0), 0) == ([], [], [])


def test_zero_collectives_priced_where_the_trainer_issues_them():
    """p = 1: the pipeline is m·(F + B); ZeRO-2 adds a reduce-scatter to each B and gathers after the step,
    ZeRO-3 also gathers before each F and B (or once per step, kept)."""
    base = dataclasses.replace(RUN, zero=1, precision="fp32")
    params = sum(x.numel for x in stage_tensors(base, 0))
    ring = 3 * -(-params // 4) * 4  # bytes one rank sends in a reduce-scatter or all-gather (fp32)
    one = predict_local(base, CPU_DEFAULT)
    two = predict_local(dataclasses.replace(base, zero=2), CPU_DEFAULT)
    three = predict_local(dataclasses.replace(base, zero=3), CPU_DEFAULT)
    kept = predict_local(dataclasses.replace(base, zero=3, reshard=False), CPU_DEFAULT)
    m = base.microbatches
    assert two.time["pipeline"] - one.time["pipeline"] == pytest.approx(m * _time(ring), rel=1e-9)
    assert two.time["dp"] == pytest.approx(_time(ring)) and one.time["dp"] == pytest.approx(2 * _time(ring))
    assert three.time["pipeline"] - one.time["pipeline"] == pytest.approx(3 * m * _time(ring), rel=1e-9)
    assert three.time["dp"] == 0.0 and kept.time["dp"] == pytest.approx(_time(ring))
    assert kept.time["pipeline"] == pytest.approx(two.time["pipeline"], rel=1e-12)


def test_all_reduce_hides_behind_the_last_backward_bucket_by_bucket():
    """ZeRO-0, d = 4, fp64, as ``training.grads`` issues it: a bucket starts once the last backward has produced
    it, one after the other. One bucket holding the whole gradient starts at the backward's end (all exposed);
    cut into buckets, a long backward hides all but the last, a short one hides nothing; on a CPU, where gloo
    reduces on the cores that compute, nothing hides."""
    gpu = dataclasses.replace(CPU_DEFAULT, device="cuda")
    one = dataclasses.replace(RUN, zero=0)
    whole = _time(allreduce_bytes(sum(stage_buckets(one, 0)) * 8, 4))
    assert len(stage_buckets(one, 0)) == 1
    assert all_reduce_exposed(one, gpu, [0], 1.0) == pytest.approx(whole)
    assert all_reduce_exposed(dataclasses.replace(one, overlap=False), gpu, [0], 1.0) == pytest.approx(whole)
    cut = dataclasses.replace(one, bucket_elements=2000)
    sizes = stage_buckets(cut, 0)
    assert len(sizes) >= 4 and sum(sizes) == sum(stage_buckets(one, 0))
    each = [_time(allreduce_bytes(n * 8, 4)) for n in sizes]
    assert all_reduce_exposed(cut, gpu, [0], 10.0) == pytest.approx(each[-1])  # the last is ready at the end
    assert all_reduce_exposed(cut, gpu, [0], 1e-12) == pytest.approx(sum(each) - 1e-12)
    assert all_reduce_exposed(dataclasses.replace(cut, overlap=False), gpu, [0], 10.0) == pytest.approx(sum(each))
    assert all_reduce_exposed(cut, CPU_DEFAULT, [0], 10.0) == pytest.approx(sum(each))  # a CPU hides nothing
    assert all_reduce_exposed(dataclasses.replace(one, d=1), gpu, [0], 1.0) == 0.0  # nothing to reduce


def test_planner_offers_zero_2_and_3_when_a_bucket_holds_a_shard():
    caps = Capabilities(schedules=("1f1b",), recompute=("none",), sequence_parallel=False)
    zeros = {r.zero for r in layouts(TINY, 4, 16, caps, RUN) if r.d == 4}
    assert zeros == {0, 1, 2, 3}
    small = dataclasses.replace(RUN, bucket_elements=100)  # below one shard of the 256 × 32 embedding over 4
    assert {r.zero for r in layouts(TINY, 4, 16, caps, small) if r.d == 4} == {0, 1}


def _profile(**changes) -> HardwareProfile:
    return dataclasses.replace(CPU_DEFAULT, cores=2, elementwise_gbps={"1": 5.0, "4": 2.0}, **changes)


def test_core_share():
    hw = _profile()
    at = lambda world: core_share(dataclasses.replace(RUN, d=world), hw)  # noqa: E731
    assert (at(1), at(2), at(4), at(8), at(16)) == (1.0, 1.0, 1.0, 2.0, 4.0)  # measured up to 4 on 2 cores
    assert core_share(dataclasses.replace(RUN, d=8), dataclasses.replace(hw, cores=0)) == 1.0  # unknown cores
    slow = predict_local(dataclasses.replace(RUN, d=8, batch=32), hw)
    fast = predict_local(dataclasses.replace(RUN, d=8, batch=32), dataclasses.replace(hw, cores=8))
    assert slow.time["pipeline"] > fast.time["pipeline"]


def test_busy_pair_fit_prices_pair_messages():
    hw = _profile(busy={"p2p": {"2": [1e-3, 0.5]}, "all_reduce": {"4": [2e-3, 0.5]}})
    run = dataclasses.replace(RUN, d=1, p=2)
    assert _comm(run, hw, "p2p", 2, 1e6) == pytest.approx(1e-3 + 1e6 / 0.5e9)
    assert _comm(dataclasses.replace(run, p=4), hw, "p2p", 2, 1e6) == pytest.approx(1e-3 + 1e6 / 0.5e9)
    assert _comm(run, hw, "all_reduce", 2, 1e6) == pytest.approx(2e-3 + 1e6 / 0.5e9)  # the fewest measured
    assert _comm(run, hw, "all_gather", 2, 1e6) == pytest.approx(_time(1e6))  # not measured busy: the idle fit
    assert _comm(dataclasses.replace(run, p=4), hw, "all_reduce", 4, 1e6) == pytest.approx(_time(1e6))  # pairs only
    assert predict_local(run, hw).step_time_s > predict_local(run, _profile()).step_time_s


def test_measured_points_are_interpolated():
    """Kept sizes price a message between them by their line, below them as the smallest, above them as the
    largest plus the rest at the fit's bandwidth; the line alone where none are kept."""
    points = [[1e3, 1e-3], [1e5, 2e-3], [1e6, 3e-3]]
    hw = _profile(busy={"all_reduce": {"2": [5e-3, 0.5, points]}})
    cost = hw.busy_cost("all_reduce", 2)
    assert cost is not None
    assert cost.time(10.0) == 1e-3 and cost.time(1e5) == 2e-3
    assert cost.time(5.5e5) == pytest.approx(2.5e-3)  # halfway between 1e5 and 1e6
    assert cost.time(2e6) == pytest.approx(3e-3 + 1e6 / 0.5e9)
    run = dataclasses.replace(RUN, d=1, t=2)
    assert _comm(run, hw, "all_reduce", 2, 1e5) == 2e-3  # not the line's 5.2 ms
    assert _profile(busy={"all_reduce": {"2": [5e-3, 0.5]}}).busy_cost("all_reduce", 2).time(1e5) == 5e-3 + 1e5 / 0.5e9


@pytest.mark.parametrize("busy, message", [({"bcast": {"2": [0.0, 1.0]}}, "busy op must be one of"),
                                           ({"p2p": {"2": [0.0]}}, "must be [latency_s, GB/s]"),
                                           ({"p2p": {"2": [0.0, 1.0, [[2.0, 1.0], [1.0, 2.0]]]}},
                                            "points must be in ascending bytes"),
                                           ({"p2p": {"2": [0.0, 1.0, [[2.0]]]}}, "points must be [[bytes, seconds]"),
                                           ({"p2p": {"x": [0.0, 1.0]}}, "busy[p2p] ranks must be a whole number")])
def test_bad_busy_table(busy, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _profile(busy=busy)


CP = LocalLayout(TINY, microbatches=2, batch=2, precision="fp32", cp=2)  # b = 1: 8 of the 16 tokens per rank


def test_cp_activations_by_hand():
    """GPT, t = 1, per token of a layer: (2h + 4) + 2h + (4h + 2·ffn) + a = 520 elements; cp = 2 keeps them for
    8 tokens, the ring its merged output besides (+h), the all-gather the gathered k and v (+2·cp·h); the first
    stage the ids and the 8 zig-zag positions (8 bytes each), the last (h + 2 + h)·4 + 8 + 4 bytes per token + 8
    (the chunked loss: the norm's, the head's input, the target and one log-sum-exp; with the logits whole,
    (h + 2 + h + V)·4 + 10: their softmax and the loss's masks)."""
    ends = 8 * 8 + 8 * ((34 + 32) * 4 + 8 + 4) + 8
    assert activation_bytes(dataclasses.replace(CP, cp=1), 0) == 4 * 16 * 520 * 4 + 16 * 8 + 16 * 276 + 8
    whole = dataclasses.replace(CP, cp=1, chunked_loss=False)
    assert activation_bytes(whole, 0) == 4 * 16 * 520 * 4 + 16 * 8 + 16 * ((34 + 32 + 256) * 4 + 10) + 8
    assert activation_bytes(CP, 0) == 4 * 8 * (520 + 32) * 4 + ends + 8 * 8
    assert activation_bytes(dataclasses.replace(CP, cp_comm="allgather"), 0) == 4 * 8 * (520 + 128) * 4 + ends + 8 * 8
    assert activation_bytes(dataclasses.replace(CP, recompute="selective", cp_comm="allgather"), 0) == \
        4 * 8 * (520 - 4) * 4 + ends + 8 * 8  # only the core's local inputs: neither term, nor the log-sum-exp


def test_batch_views_by_hand():
    """The ids (t = 1) and the chunked loss's targets are views of the rank's batch: one microbatch's share and
    the whole batch, 8 bytes a token each. RUN: 16 sequences over d = 4, 2 microbatches of 2, s = 16, one stage."""
    assert batch_view_bytes(RUN, 0) == (2 * 16 * 2 * 8, 4 * 16 * 2 * 8)  # ids and targets: the stage is both ends
    assert batch_view_bytes(dataclasses.replace(RUN, t=2), 0) == (2 * 16 * 8, 4 * 16 * 8)  # t > 1: shifted ids
    assert batch_view_bytes(dataclasses.replace(RUN, t=2, chunked_loss=False), 0) == (0, 0)  # its own targets
    two = dataclasses.replace(RUN, p=2)
    assert batch_view_bytes(two, 0) == batch_view_bytes(two, 1) == (2 * 16 * 8, 4 * 16 * 8)
    assert batch_view_bytes(CP, 0) == (8 * 2 * 8, 2 * 8 * 2 * 8)  # cp = 2: this rank's 8 tokens of each sequence


def test_cp_joins_the_gradient_group():
    """World t·cp·p·d; the gradients all-reduced, and ZeRO-1's state and traffic sharded, over d·cp."""
    run = dataclasses.replace(CP, t=2, p=2, d=3, batch=6)
    assert (run.world, run.grad_ranks, run.tokens) == (24, 6, 8)
    one = dataclasses.replace(CP, zero=1)
    params = sum(x.numel for x in stage_tensors(one, 0))
    assert dp_bytes_step(one, [0]) == dp_bytes_sent(params, 2, 1, 4, 4, one.microbatches, True)
    assert 2 * state_bytes(one, [0])["optimizer"] == state_bytes(CP, [0])["optimizer"]
    exposed = dataclasses.replace(CP, overlap=False)
    grads = state_bytes(CP, [0])["gradients"]
    assert predict_local(exposed, CPU_DEFAULT).time["dp"] == pytest.approx(_time(allreduce_bytes(grads, 2)))
    assert predict_local(dataclasses.replace(exposed, cp=1), CPU_DEFAULT).time["dp"] == 0.0


def test_cp_ring_hides_its_hops_the_allgather_not():
    """kv = 2·b·(s/cp)·h·4 = 2048 bytes. Ring: each hop beside a block's attention, so with a long block only the last
    gradient hop is exposed, with none (or on a CPU) 1 + (2 + 1) hops; all-gather: k and v gathered (1024 bytes sent each), and
    reduce-scattered in the backward, whole."""
    hop, gpu = _time(2048), dataclasses.replace(CPU_DEFAULT, device="cuda")
    assert cp_layer_seconds(CP, gpu, 1.0) == (0.0, pytest.approx(hop))
    assert cp_layer_seconds(CP, gpu, 0.0) == (pytest.approx(hop), pytest.approx(3 * hop))
    assert cp_layer_seconds(CP, CPU_DEFAULT, 1.0) == (pytest.approx(hop), pytest.approx(3 * hop))  # a CPU: no overlap
    shift = 2e-3 + 2048 / 0.5e9  # both ranks send and receive at once: the measured exchange, where there is one
    measured = _profile(busy={"exchange": {"2": [2e-3, 0.5]}, "p2p": {"2": [1e-4, 1.0]}})
    assert cp_layer_seconds(CP, measured, 0.0) == (pytest.approx(shift), pytest.approx(3 * shift))
    gather = 2 * _time(1024)
    assert cp_layer_seconds(dataclasses.replace(CP, cp_comm="allgather"), CPU_DEFAULT, 1.0) == \
        (pytest.approx(gather), pytest.approx(gather))
    assert cp_layer_seconds(dataclasses.replace(CP, cp=1), CPU_DEFAULT, 0.0) == (0.0, 0.0)


def test_moe_rank_bytes_by_hand():
    """Layer 1 of 2 is a MoE (E = 4 experts of width 8, one shared): on each of ep = 2 ranks the embedding 512,
    layer 0 656 (norms 16, q 64, k|v 128, o 64, SwiGLU 256 + 128), layer 1 272 of attention and norms + router 32
    + its 2 experts (256, 128: their own buckets) + the shared SwiGLU 128 + 64, the final norm 8, the head 512."""
    spec = ModelSpec(layers=2, hidden=8, heads=2, seq=4, vocab=64, ffn=16, gated_mlp=True, tied_embeddings=False,
                     learned_positions=False, bias=False, dropout=False)
    run = LocalLayout(spec, d=2, moe=MoESpec(experts=4, ffn=8, shared=1, every=2), ep=2)
    assert state_bytes(run, [0]) == {"parameters": 2568 * 4, "gradients": 2568 * 4, "optimizer": 2568 * 8}
    assert stage_buckets(run, 0)[-2:] == [256, 128] and sum(stage_buckets(run, 0)) == 2568
    whole = dataclasses.replace(run, ep=1)  # all 4 experts here, in the ordinary buckets
    assert sum(x.numel for x in stage_tensors(whole, 0)) == 2568 + 384 == 512 + 656 + 272 + 992 + 8 + 512
    assert moe_layer_params(8, 4, 8, shared=1) == 992


@pytest.mark.parametrize("schedule,split,ranks", [("interleaved", (0, 2, 1, 1), (1, 3)), ("interleaved", (3, 0, 0, 1), (3, 1)),
                                                  ("zb-v", (3, 0, 0, 1), (4, 0)), ("auto", (3, 0, 0, 1), (3, 1))])
def test_whole_stage_costs_of_an_uneven_chunked_split_add_up_each_ranks_chunks(schedule, split, ranks):
    """``schedule auto`` and the V shapes are built from p whole stages: a p·v ``--stage-layers`` split is each
    rank's chunks added up (the loop placement, or the V's d and 2p − 1 − d), priced as that many layers."""
    run = LocalLayout(TINY, p=2, v=2, microbatches=4, batch=8, precision="fp64", schedule=schedule, stage_layers=split)
    even = dataclasses.replace(run, v=1, stage_layers=ranks)
    assert stage_costs(run, CPU_DEFAULT) == stage_costs(even, CPU_DEFAULT)
