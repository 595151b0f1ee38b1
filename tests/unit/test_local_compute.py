"""The local cost model's measured compute (costmodel.local_compute), hand-checked: a measured layer, stage end,
blockwise attention, runtime and optimizer step price exactly what was measured at a measured shape, the kernels'
difference elsewhere in the grid, the kernels outside it. Pure Python: no timing."""

import dataclasses
import math

import pytest

from modelpar.calibrate.layers import fit_optimizer
from modelpar.costmodel.local import predict_local
from modelpar.costmodel.local_compute import (
    blockwise_seconds,
    end_seconds,
    grid_model,
    interpolate,
    kernel_ends,
    kernel_layer,
    layer_seconds,
    step_end_seconds,
)
from modelpar.costmodel.local_memory import LocalLayout
from modelpar.costmodel.presets import CPU_DEFAULT
from modelpar.costmodel.profiles import HardwareProfile
from modelpar.model import ModelConfig

MODEL = ModelConfig(hidden=64, heads=4, layers=4, seq_len=64).spec()  # padded vocabulary 256
RUN = LocalLayout(MODEL, microbatches=2, batch=16)  # 8 sequences, 512 tokens per micro-batch
# layer rows: [hidden, heads, seq, tokens, fwd, bwd, fwd recomputed, bwd recomputed]
LAYER = [[h, 4, 64, n, 1e-3 * h / 64 * n / 128, 2e-3 * h / 64 * n / 128, 1.1e-3, 3e-3]
         for h in (64, 128) for n in (128, 512)]
ENDS = [[h, n, 256, 1e-4, 2e-4, 5e-4, 9e-4] for h in (64, 128) for n in (128, 512)]
BLOCKS = [[2, h, 64, n, 4e-4 * n / 64, 8e-4 * n / 64] for h in (64, 128) for n in (64, 256)]
HW = dataclasses.replace(CPU_DEFAULT, cores=2, layer={"fp32": {"1": LAYER}}, ends={"fp32": {"1": ENDS}},
                         blockwise={"fp32": {"1": BLOCKS}}, runtime_s={"1": [2e-4, 1e-3]},
                         optimizer={"1": [1e-3, 5e-5, 2.0]})


def test_interpolate_is_exact_on_the_grid_log_bilinear_between_and_none_outside():
    rows = [[x, y, x * y] for x in (1, 4) for y in (10, 1000)]
    value = lambda r: [r[2]]  # noqa: E731
    assert interpolate(rows, (0, 1), (4, 10), value) == [40]
    assert interpolate(rows, (0, 1), (2, 10), value) == pytest.approx([(1 * 10 + 4 * 10) / 2])  # log-midpoint in x
    assert interpolate(rows, (0, 1), (2, 100), value) == pytest.approx([(10 + 1000 + 40 + 4000) / 4])
    assert interpolate(rows, (0, 1), (8, 100), value) is None and interpolate(rows, (0, 1), (2, 5), value) is None
    assert interpolate(rows[:3], (0, 1), (2, 100), value) is None  # a corner missing
    assert interpolate([], (0, 1), (1, 10), value) is None


def test_a_measured_layer_is_priced_as_measured():
    """h = 64, 512 tokens, t = 1: the row itself; full recomputation: its recomputed columns."""
    cost = layer_seconds(RUN, HW)
    assert (cost.forward, cost.backward) == pytest.approx((4e-3, 8e-3), rel=1e-12)
    full = layer_seconds(dataclasses.replace(RUN, recompute="full"), HW)
    assert (full.forward, full.backward) == pytest.approx((1.1e-3, 3e-3), rel=1e-12)
    composed, _ = kernel_layer(RUN, HW)
    assert cost.weight == pytest.approx(8e-3 * composed.weight / composed.backward, rel=1e-12)


def test_the_grid_is_priced_at_the_runs_process_count():
    """d = 2 at a measured shape: the 2-process row itself, though the kernels measured with 1 and 2 processes
    differ (the grid's composition is priced with the run's 2 processes, not the one the grid shape has)."""
    hw = dataclasses.replace(HW, matmul={"fp32": {"1": [[256, 256, 256, 0.05]], "2": [[256, 256, 256, 0.02]]}},
                             layer={"fp32": {"2": LAYER}}, devices_per_node=2)
    run = dataclasses.replace(RUN, d=2, microbatches=1)  # 8 sequences per replica, 512 tokens
    cost = layer_seconds(run, hw)
    assert (cost.forward, cost.backward) == pytest.approx((4e-3, 8e-3), rel=1e-12)


def test_between_grid_points_and_at_t2_the_kernels_difference_is_added():
    """256 tokens: what the kernels miss, interpolated (log-midpoint of 128 and 512); t = 2: the measured t = 1
    layer plus the kernels' t = 2 minus t = 1 (the missed part is not divided by t)."""
    run = dataclasses.replace(RUN, microbatches=4)  # 256 tokens
    composed, _ = kernel_layer(run, HW)
    missed = []
    for n in (128, 512):
        at, _ = kernel_layer(grid_model(run, 64, 4, 64, n, 256), HW)
        missed.append(1e-3 * n / 128 - at.forward)
    assert layer_seconds(run, HW).forward == pytest.approx(composed.forward + sum(missed) / 2, rel=1e-12)
    tp = dataclasses.replace(RUN, t=2)
    one, _ = kernel_layer(RUN, HW)
    two, _ = kernel_layer(tp, HW)
    assert layer_seconds(tp, HW).forward == pytest.approx(4e-3 + two.forward - one.forward, rel=1e-12)
    assert two.forward < one.forward


def test_outside_the_grid_or_without_tables_the_kernels_price_it():
    big = dataclasses.replace(RUN, model=ModelConfig(hidden=512, heads=4, layers=4, seq_len=64).spec())
    composed, _ = kernel_layer(big, HW)
    assert layer_seconds(big, HW).forward == composed.forward
    composed, _ = kernel_layer(RUN, CPU_DEFAULT)
    assert layer_seconds(RUN, CPU_DEFAULT).forward == composed.forward


def test_selective_recomputation_adds_the_attention_forward():
    sel = layer_seconds(dataclasses.replace(RUN, recompute="selective"), HW)
    _, attention = kernel_layer(RUN, HW)
    assert sel.backward == pytest.approx(8e-3 + attention, rel=1e-12)


def test_stage_ends_measured_on_their_stages():
    """One stage holds both ends: embedding + head rows; at p = 2 the first holds the embedding only."""
    one = end_seconds(RUN, HW, 0)
    assert (one.forward, one.backward) == pytest.approx((6e-4, 1.1e-3), rel=1e-12)
    two = dataclasses.replace(RUN, p=2)
    first, last = end_seconds(two, HW, 0), end_seconds(two, HW, 1)
    assert (first.forward, first.backward, first.weight) == pytest.approx((1e-4, 2e-4, 0.0), rel=1e-12)
    assert (last.forward, last.backward) == pytest.approx((5e-4, 9e-4), rel=1e-12)
    _, head = kernel_ends(two, HW, 1)
    assert last.weight == head.weight


def test_blockwise_attention_at_cp2():
    """cp = 2, 256 local tokens (the run's 8 sequences of 32): the measured blocks, a t-th of them at t = 2."""
    run = dataclasses.replace(RUN, cp=2)
    assert blockwise_seconds(run, HW) == pytest.approx((1.6e-3, 3.2e-3), rel=1e-12)
    assert blockwise_seconds(dataclasses.replace(run, t=2), HW) == pytest.approx((0.8e-3, 1.6e-3), rel=1e-12)
    assert blockwise_seconds(RUN, HW) is None and blockwise_seconds(dataclasses.replace(run, cp=4), HW) is None
    composed, attention = kernel_layer(run, HW)  # 256 tokens: the log-midpoint of the layer grid
    missed_f = (1e-3 - kernel_layer(grid_model(run, 64, 4, 64, 128, 256), HW)[0].forward
                + 4e-3 - kernel_layer(grid_model(run, 64, 4, 64, 512, 256), HW)[0].forward) / 2
    assert layer_seconds(run, HW).forward == pytest.approx(composed.forward - attention + 1.6e-3 + missed_f, rel=1e-12)


def test_step_end_and_runtime():
    """The optimizer fit: latency + tensors·per tensor + state bytes / bandwidth; the runtime adds its cost per
    action to each F and B (p = 1, m = 2: 4 actions) and its cost per step once."""
    assert step_end_seconds(RUN, HW, 10, 0.0, 4e9) == pytest.approx(1e-3 + 10 * 5e-5 + 2.0, rel=1e-12)
    without = dataclasses.replace(HW, runtime_s={})
    a, b = predict_local(RUN, HW), predict_local(RUN, without)
    assert a.time["pipeline"] - b.time["pipeline"] == pytest.approx(4 * 2e-4, rel=1e-9)
    assert a.time["optimizer"] - b.time["optimizer"] == pytest.approx(1e-3, rel=1e-9)


def test_a_step_end_measured_whole_holds_the_norm_and_agreement_collectives():
    """At d = 2 a step end fitted from the trainer's own (``step_end_measured``) already holds the norm's all-reduce
    and the stop agreement's all-gather; one fitted from the optimizer alone has them priced on top."""
    from modelpar.costmodel.local import _comm
    from modelpar.formulas import allgather_bytes

    run = dataclasses.replace(RUN, d=2)
    two = dataclasses.replace(HW, optimizer={"2": [1e-3, 5e-5, 2.0]})
    apart, whole = predict_local(run, two), predict_local(run, dataclasses.replace(two, step_end_measured=True))
    collectives = _comm(run, two, "all_reduce", 2, 8) + _comm(run, two, "all_gather", 2, allgather_bytes(96.0, 2))
    assert collectives > 0 and apart.time["optimizer"] - whole.time["optimizer"] == pytest.approx(collectives, rel=1e-9)


def test_fit_optimizer_recovers_hand_made_rows():
    rows = [(t, b, 1e-3 + t * 2e-5 + b / 4e9) for t, b in ((10, 1e6), (40, 1e6), (20, 8e6), (30, 3e6))]
    latency, per_tensor, gbps = fit_optimizer(rows)
    assert (latency, per_tensor, gbps) == pytest.approx((1e-3, 2e-5, 4.0), rel=1e-6)
    flat = fit_optimizer([(t, b, 1e-3 + b / 4e9 - t * 1e-6) for t, b, _ in rows])  # a negative term is dropped
    assert flat[1] == 0.0 and all(x >= 0 for x in flat) and math.isfinite(flat[2])


@pytest.mark.parametrize("field, value, message", [
    ("layer", {"fp32": {"1": [[64, 4, 64, 128, 1e-3]]}}, "layer[fp32][1] rows must be 8 numbers"),
    ("ends", {"fp32": {"1": [[0, 128, 256, 1, 1, 1, 1]]}}, "ends[fp32][1] rows must be 7 numbers"),
    ("blockwise", {"fp32": {"1": [[2, 64, 64, 128, -1.0, 0.0]]}}, "blockwise[fp32][1] rows"),
    ("runtime_s", {"1": [1e-4]}, "runtime_s[1] rows must be 2 numbers"),
    ("optimizer", {"1": [1e-3, 1e-5, 0.0]}, "optimizer[1] GB/s"),
    ("tp_layer", {"fp32": {"2": [[2, 64, 4, 64, 128, 1e-3, 2e-3, 1e-3]]}}, "tp_layer[fp32][2] rows must be 9 numbers"),
    ("layer_compiled", {"fp32": {"1": [[64, 4, 64, 128, 1e-3]]}}, "layer_compiled[fp32][1] rows must be 8 numbers"),
])
def test_malformed_tables_are_named(field, value, message):
    data = HW.to_json()
    data[field] = value
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        HardwareProfile.from_json(data)
    assert HardwareProfile.from_json(HW.to_json()) == HW


# tp_layer rows: [t, hidden, heads, seq, tokens, fwd, bwd, fwd recomputed, bwd recomputed], collectives included
TP_LAYER = [[2, h, 4, 64, n, 5e-3 * h / 64, 9e-3 * h / 64 * n / 128, 6e-3, 1.6e-2] for h in (64, 128) for n in (128, 512)]
TP_HW = dataclasses.replace(HW, layer={"fp32": {"1": LAYER, "2": LAYER}}, tp_layer={"fp32": {"2": TP_LAYER}})


def test_a_measured_tensor_parallel_layer_is_priced_as_measured():
    """t = 2 at a measured shape (h = 64, 512 tokens): the row itself, collectives and all; full recomputation
    its recomputed columns; between grid points the priced difference is added; without the table, at another t
    or with sequence parallelism, the layer and its collectives priced one by one."""
    from modelpar.costmodel.local import _priced_tp_layer, tp_layer_seconds

    run = dataclasses.replace(RUN, t=2, microbatches=2, batch=16)  # world 2, 512 tokens per micro-batch
    forward, backward, _ = tp_layer_seconds(run, TP_HW)
    assert (forward, backward) == pytest.approx((5e-3, 3.6e-2), rel=1e-12)
    full = dataclasses.replace(run, recompute="full")
    assert tp_layer_seconds(full, TP_HW)[:2] == pytest.approx((6e-3, 1.6e-2), rel=1e-12)
    between = dataclasses.replace(run, microbatches=4)  # 256 tokens, between 128 and 512
    f, b, _ = tp_layer_seconds(between, TP_HW)
    pf, pb, _ = _priced_tp_layer(between, TP_HW)
    assert f != pytest.approx(pf) and f == pytest.approx(5e-3 + pf - _priced_tp_layer(run, TP_HW)[0] / 2
                                                        - _priced_tp_layer(dataclasses.replace(run, microbatches=8),
                                                                           TP_HW)[0] / 2, rel=1e-9)
    plain = tp_layer_seconds(run, HW)
    assert plain == _priced_tp_layer(run, HW)
    assert tp_layer_seconds(dataclasses.replace(run, sequence_parallel=True), TP_HW) == \
        _priced_tp_layer(dataclasses.replace(run, sequence_parallel=True), TP_HW)
    four = dataclasses.replace(run, t=4, batch=16)
    assert tp_layer_seconds(four, TP_HW) == _priced_tp_layer(four, TP_HW)
    assert predict_local(run, TP_HW).step_time_s != predict_local(run, dataclasses.replace(TP_HW, tp_layer={})).step_time_s


def test_a_measured_layer_far_below_its_price_keeps_the_backward_above_its_weight_part():
    """A short calibration measured the t = 2 layer's backward far below its price (seen: the README's first run
    stopped with "input_grad[0] must be >= 0.0"; here a hundredth of the table's): the backward is clamped at its
    weight-gradient part, so a split backward's I = B − W is never negative and the run is priced."""
    from modelpar.costmodel.local import stage_costs, tp_layer_seconds

    run = dataclasses.replace(RUN, t=2, p=2, microbatches=2, batch=16)
    fast = [[*r[:5], r[5], r[6] / 100, *r[7:]] for r in TP_LAYER]
    hw = dataclasses.replace(TP_HW, tp_layer={"fp32": {"2": fast}})
    _, backward, layer = tp_layer_seconds(run, hw)
    assert backward == layer.weight > 0
    costs = stage_costs(run, hw)
    assert min(costs.input_grad) >= 0 and predict_local(run, hw).step_time_s > 0


# the layer as --compile runs it: half the eager layer's times (calibrate --compile: forward, backward, and full
# recomputation derived from them)
COMPILED = [[*r[:4], r[4] / 2, r[5] / 2, r[4] / 2, (r[4] + r[5]) / 2] for r in LAYER]


def test_a_compiled_run_is_priced_from_the_compiled_layer_where_measured():
    """At a measured shape the compiled row itself (full recomputation: the forward again in the backward); an
    eager run on the same profile keeps the eager row; a compiled run on a profile without the compiled table is
    priced as the eager run; the whole step follows."""
    from modelpar.costmodel.local_compute import compiled_measured

    hw = dataclasses.replace(HW, layer_compiled={"fp32": {"1": COMPILED}})
    run = dataclasses.replace(RUN, compiled=True)  # h = 64, 512 tokens
    cost = layer_seconds(run, hw)
    assert (cost.forward, cost.backward) == pytest.approx((2e-3, 4e-3), rel=1e-12) and compiled_measured(run, hw)
    full = layer_seconds(dataclasses.replace(run, recompute="full"), hw)
    assert (full.forward, full.backward) == pytest.approx((2e-3, 6e-3), rel=1e-12)
    assert layer_seconds(RUN, hw) == layer_seconds(RUN, HW)  # not compiled: the eager table
    assert layer_seconds(run, HW) == layer_seconds(RUN, HW) and not compiled_measured(run, HW)
    assert predict_local(run, hw).step_time_s < predict_local(RUN, hw).step_time_s


def test_a_compiled_tensor_parallel_layer_keeps_the_eager_tables_residual():
    """t = 2: the measured t = 2 layer is eager (its collectives break a compiled block's graph), so its residual
    over the eager price is added to the compiled price: the compiled t = 2 layer costs the eager measurement less
    what compiling saves in its compute, as priced."""
    from modelpar.costmodel.local import _priced_tp_layer, tp_layer_seconds

    hw = dataclasses.replace(TP_HW, layer_compiled={"fp32": {"1": COMPILED, "2": COMPILED}})
    eager = dataclasses.replace(RUN, t=2, microbatches=2, batch=16)
    compiled = dataclasses.replace(eager, compiled=True)
    forward, backward, _ = tp_layer_seconds(compiled, hw)
    saved_f = _priced_tp_layer(eager, hw)[0] - _priced_tp_layer(compiled, hw)[0]
    assert saved_f > 0 and forward == pytest.approx(5e-3 - saved_f, rel=1e-9)
    assert tp_layer_seconds(eager, hw)[:2] == pytest.approx((5e-3, 3.6e-2), rel=1e-12)
