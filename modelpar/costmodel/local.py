"""The cost model's prediction for one ``modelpar train`` layout on a hardware profile: step time, bubble, bytes.

Each action of the run's own schedule is priced from the profile (``profiles.py``): its compute by
``local_compute`` (the model's own layer, stage ends, blockwise attention, runtime and optimizer step as
calibrate measured them, inside the measured grid; else composed from the GEMM, attention, element-wise
and per-op fits), the tensor-parallel collectives (2 forward, 2 backward per layer; sequence
parallelism: all-gather + reduce-scatter; the embedding's and the head's, and the vocabulary-parallel
cross entropy's 3 small all-reduces: what the runtime issues, counted with ``tensor_parallel.accounting``
in tests/unit/test_local_costs.py) — and the schedule is timed by the simulator
(``modelpar.schedules.replay``) with those durations and the point-to-point cost per boundary.
Then the step's end: the data-parallel reduction (bucket by bucket, what the last backward cannot hide:
``all_reduce_exposed``), and the step end (``local_compute.step_end_seconds``): on a CPU profile the trainer's own,
measured by training (the batch, the norm and its all-reduce, the stop agreement, AdamW, the zeroing:
``HardwareProfile.step_end_measured``); on a GPU the norm, AdamW and zeroing, with the norm's all-reduce and the
agreement's all-gather priced beside them. Nothing is fitted: every number is the profile's or counted.
Memory is ``local_memory``'s exact per-rank figures; on a GPU profile the busiest rank's bytes add what the caching
allocator holds beyond them (``costmodel.allocator``: autocast's weight copies, workspaces; ``allocated_bytes``).

Messages and pair collectives are priced as the trainer issues them where the profile has it
(``HardwareProfile.busy``: right after compute, every rank busy — a blocked receiver's wake-up and
a partner's late arrival included), else by the idle fits. ZeRO-2 and 3 (``dp_traffic``, bucket by
bucket as ``training.zero_grads``/``zero_params`` issue them): every backward reduce-scatters its
stage's buckets, ZeRO-3 all-gathers them before every forward and backward (once per step without
resharding), ZeRO-1 and 2 all-gather the parameters after the step; each collective is priced
exposed, in the action that issues it (gloo reduces on the cores that compute). More ranks than
cores (``local_compute.core_share``): compute measured with fewer processes slows by ranks / max(measured, cores).

Context parallelism (cp > 1): GEMMs, element-wise work and the tensor-parallel and point-to-point
messages are those of a rank's s/cp tokens, attention still sees the whole sequence per token
(4·b·(s/cp)·s·h/t FLOPs forward, or the measured blockwise attention); the key/value traffic and what attention hides of it are
``costmodel.context``'s rules (``cp_blocks``, ``cp_exposed``: the ring's hops beside a block's attention,
the all-gather's not); gradients are reduced, and ZeRO-1 shards, over the d·cp ranks.

Mixture of experts (one marked place in ``_stage_costs``, the terms in ``costmodel.moe``): a MoE
layer's router, experts at their uniform-routing rows and shared experts in place of the SwiGLU's
GEMMs, its extra dispatched ops, and its two all-to-alls each way (ep = 2: a pair's exchange, the
busy p2p fit; more: the ep group's all-gather fit at the same bytes per rank), exposed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from modelpar.costmodel.allocator import allocator_bytes, optimizer_tensors
from modelpar.costmodel.context import cp_exposed, kv_block_bytes
from modelpar.costmodel.inventory import bucket_shards, stage_bucket_list, stage_layers, stage_tensors
from modelpar.costmodel.local_compute import (
    LayerCost,
    attention_seconds,
    blockwise_seconds,
    core_share,
    end_seconds,
    grid_model,
    interpolate,
    layer_seconds,
    matmul_seconds,
    runtime_seconds,
    step_end_seconds,
    table_dtype,
)
from modelpar.costmodel.local_memory import (
    COMPUTE_BYTES,
    LocalLayout,
    activation_bytes,
    moe_layers_of,
    offloaded_bytes,
    state_bytes,
)
from modelpar.costmodel.measured import layer_gemms
from modelpar.costmodel.moe import MoESeconds, moe_layer_seconds, moe_spans
from modelpar.costmodel.profiles import HardwareProfile
from modelpar.formulas import allgather_bytes, allreduce_bytes
from modelpar.schedules import get_schedule
from modelpar.schedules.action import Kind
from modelpar.schedules.kinds import KINDS, kind_times
from modelpar.schedules.registry import schedule_entry
from modelpar.schedules.replay import replay_times
from modelpar.schedules.schedule import Schedule, loop_map, v_map
from modelpar.simulate.synthesis import StageCosts, synthesize
from modelpar.simulate.timeline import Timeline

__all__ = [
    "PRICED_ZERO",
    "LocalPrediction",
    "all_reduce_exposed",
    "auto_schedule",
    "core_share",
    "cp_layer_seconds",
    "dp_bytes_step",
    "dp_traffic",
    "layout_schedule",
    "moe_stage_seconds",
    "offload_seconds",
    "predict_local",
    "predicted_timeline",
    "stage_costs",
    "tp_collectives",
    "tp_grad_sync",
]

PRICED_ZERO = (0, 1, 2, 3)  # ZeRO stages whose step this model prices


@dataclass(frozen=True)
class LocalPrediction:
    """Predicted step of one layout: seconds, the pipeline bubble, and the busiest rank's bytes."""

    step_time_s: float
    bubble: float  # idle share of the pipeline (the simulator's, with these costs)
    time: dict[str, float]  # pipeline, dp (exposed), optimizer
    memory: dict[str, float] = field(default_factory=dict)  # rank 0: parameters, gradients, optimizer, activations
    peak_held: int = 0  # microbatch-chunks rank 0 holds at its peak (F until B or W)
    busiest: tuple[int, float] = (0, 0.0)  # (pipeline rank, bytes) of the rank holding the most
    host_bytes: float = 0.0  # rank 0's activations in host memory at its peak (activation offload)
    allocated_bytes: float = 0.0  # rank 0's peak as a GPU's allocator sees it (``costmodel.allocator``; 0 on a CPU)

    @property
    def memory_bytes(self) -> float:
        """Bytes on the most loaded rank (training state and held activations)."""
        return self.busiest[1]

    def as_dict(self) -> dict[str, object]:
        return {"step_time_s": self.step_time_s, "bubble": self.bubble, "time_s": dict(self.time),
                "memory_bytes": dict(self.memory), "peak_held": self.peak_held,
                "busiest_rank": self.busiest[0], "busiest_bytes": self.busiest[1], "host_bytes": self.host_bytes,
                "allocated_bytes": self.allocated_bytes}


def _collective(hw: HardwareProfile, op: str, group: int, nbytes: float) -> float:
    cost = hw.collective(op, group)
    if cost is not None:
        return cost.time(nbytes)
    return nbytes / (hw.intra_node_gbps * 1e9)


def _comm(run: LocalLayout, hw: HardwareProfile, op: str, group: int, nbytes: float) -> float:
    """Seconds of ``op`` over ``group`` ranks in the run: a pair's as training issues it when measured
    (``HardwareProfile.busy`` at the run's process count), else the idle fit."""
    cost = hw.busy_cost(op, run.world) if group == 2 else None
    return cost.time(nbytes) if cost is not None else _collective(hw, op, group, nbytes)


def dp_traffic(run: LocalLayout, stage: int) -> tuple[list[float], list[float], list[float]]:
    """Bytes one rank sends per bucket of ``stage`` in a data-parallel reduce-scatter of its gradients, an
    all-gather of its parameters for compute (ZeRO-3: in the compute dtype), and the all-gather after the
    step (ZeRO-1/2: the updated parameters): (g − 1) shards of the bucket padded to a multiple of d, over the g
    ranks sharing it (``bucket_shards``: d, or d/ep for an expert bucket under ep > 1, none when g = 1; here and
    below d is the gradient group, d·cp)."""
    d, w = run.grad_ranks, run.param_bytes
    if d == 1 or not run.zero:
        return [], [], []
    shards = [math.ceil(n / d) * d // g * (g - 1) for n, g in bucket_shards(run, stage) if g > 1]
    gather = COMPUTE_BYTES[run.precision] if run.zero == 3 else 0
    return [x * w for x in shards], [x * gather for x in shards], [x * w for x in shards if run.zero < 3]


def dp_bytes_step(run: LocalLayout, stages: list[int]) -> float:
    """Data-parallel bytes the rank holding ``stages`` sends in a step under ZeRO ≥ 1 (what the trainer counts,
    ``TrainResult.dp_bytes_sent``): per microbatch, ZeRO-2/3's reduce-scatters and ZeRO-3's gathers (two per
    microbatch when resharding, else one per step); once, ZeRO-1's reduce-scatter and ZeRO-1/2's gather."""
    m = run.microbatches
    total = 0.0
    for s in stages:
        scatter, gather, after = (sum(x) for x in dp_traffic(run, s))
        total += after + scatter * (m if run.zero >= 2 else 1)
        total += gather * (2 * m if run.reshard else 1)
    return total


def _dp_times(run: LocalLayout, hw: HardwareProfile, stage: int) -> tuple[float, float, float]:
    """Seconds of ``stage``'s reduce-scatters, compute gathers and after-step gathers (one per bucket each)."""
    scatter, gather, after = dp_traffic(run, stage)
    g = run.grad_ranks
    return (sum(_comm(run, hw, "reduce_scatter", g, x) for x in scatter),
            sum(_comm(run, hw, "all_gather", g, x) for x in gather),
            sum(_comm(run, hw, "all_gather", g, x) for x in after))


def all_reduce_exposed(run: LocalLayout, hw: HardwareProfile, stages: list[int], backward_s: float) -> float:
    """ZeRO-0: seconds the data-parallel all-reduces of the buckets of ``stages`` outlast the rank's last backward
    (``backward_s``, of ``stages[0]``, whose backward ends the rank's step), one bucket after the other as
    ``training.grads`` issues them: with overlap a "backward" bucket of that stage starts once the backward has
    produced its share of the stage's gradients (in backward order), the other stages' buckets are ready before
    it, the "stage" and "step" ones (tensor-parallel sums, tied copies, experts over their d/ep) at its end;
    without overlap, or where communication cannot run beside compute (``HardwareProfile.overlaps_compute``), all
    start at its end. One bucket holding a small model's whole gradient hides nothing."""
    w, first, overlap = run.param_bytes, stages[0], run.overlap and hw.overlaps_compute
    mine = stage_bucket_list(run, first)
    produced = sum(n for n, _, ready in mine if ready == "backward")
    queue: list[tuple[float, float]] = []  # (ready, seconds)
    done = 0
    for s in stages:
        for n, ranks, ready in stage_bucket_list(run, s):
            if ranks == 1:
                continue
            at = backward_s
            if overlap and s != first and ready != "step":
                at = 0.0
            elif overlap and ready == "backward":
                done += n
                at = backward_s * done / produced
            queue.append((at, _comm(run, hw, "all_reduce", ranks, allreduce_bytes(n * w, ranks))))
    finish = 0.0
    for at, seconds in sorted(queue, key=lambda q: q[0]):
        finish = max(finish, at) + seconds
    return max(0.0, finish - backward_s)


def tp_collectives(run: LocalLayout, stage: int) -> tuple[list[tuple[str, str, float]], list[tuple[str, str, float]]]:
    """The tensor-parallel collectives one microbatch of ``stage`` issues, (op, "forward"/"backward", bytes of
    the whole tensor: an all-reduce's input, an all-gather's output, a reduce-scatter's input), as
    ``tensor_parallel.accounting`` records them: per layer, and once at the stage's ends (no recomputation).

    Per layer: g after attention and after the MLP (all-reduce forward), f before them (all-reduce backward);
    with sequence parallelism f̄ / ḡ (all-gather / reduce-scatter of the sequence, each way). The
    vocabulary-parallel embedding's g (ḡ), the head's f (f̄), and the cross entropy's 3 all-reduces of one
    fp32 (or wider) value per token: the maximum, the target logit, the sum of exponentials.
    """
    m, t = run.model, run.t
    if t == 1:
        return [], []
    e = COMPUTE_BYTES[run.precision]
    tokens = run.tokens
    act = float(tokens * m.hidden * e)
    if run.sequence_parallel:
        f = [("all_gather", "forward", act), ("reduce_scatter", "backward", act)]
        g = [("reduce_scatter", "forward", act), ("all_gather", "backward", act)]
    else:
        f, g = [("all_reduce", "backward", act)], [("all_reduce", "forward", act)]
    ends: list[tuple[str, str, float]] = []
    if stage == 0:
        ends += g
    if stage == run.stages - 1:
        ends += f + [("all_reduce", "forward", float(tokens * max(4, e)))] * 3
    return 2 * (f + g), ends


def tp_grad_sync(run: LocalLayout, stage: int) -> float:
    """Bytes of ``stage``'s gradients summed over the tensor-parallel group (one all-reduce of the replicated
    parameters that saw a shard: under sequence parallelism the norms, row biases and positions; replicated
    key/value heads): once per step, or after every backward under ZeRO-2/3. 0 when there are none."""
    if run.t == 1:
        return 0.0
    return float(sum(x.numel for x in stage_tensors(run, stage) if x.partial and not x.tied) * run.param_bytes)


def _tp_time(run: LocalLayout, hw: HardwareProfile, op: str, nbytes: float) -> float:
    sent = allreduce_bytes(nbytes, run.t) if op == "all_reduce" else allgather_bytes(nbytes, run.t)
    return _comm(run, hw, op, run.t, sent)


def _priced_tp_layer(run: LocalLayout, hw: HardwareProfile) -> tuple[float, float, LayerCost]:
    """(forward, backward, the compute alone) seconds of one layer and micro-batch with its tensor-parallel
    collectives priced one by one (``_tp_time``); full recomputation runs the forward's again in the backward."""
    layer = layer_seconds(run, hw)
    seconds = {"forward": 0.0, "backward": 0.0}
    for op, phase, nbytes in tp_collectives(run, 0)[0]:  # the per-layer ones (any stage's)
        seconds[phase] += _tp_time(run, hw, op, nbytes)
    backward = layer.backward + seconds["backward"] + (seconds["forward"] if run.recompute == "full" else 0.0)
    return layer.forward + seconds["forward"], backward, layer


def tp_layer_seconds(run: LocalLayout, hw: HardwareProfile) -> tuple[float, float, LayerCost]:
    """One layer's (forward, backward) seconds with its tensor-parallel collectives, and its compute alone:
    priced one by one (``_priced_tp_layer``), plus, where the profile measured the layer whole at the run's t
    (``tp_layer``: the trainer's layer sharded over a pair, collectives inside), what those measurements cost
    beyond that price at their shapes, interpolated to the run's (``local_compute.interpolate``; none with
    sequence parallelism, which issues other collectives, or outside the grid). At a measured shape with
    t = 2 the layer costs what it measured. A measurement far below the price (a noisy short calibration) never
    takes the backward under its own weight-gradient part: the split backward's I = B − W stays ≥ 0."""
    forward, backward, layer = _priced_tp_layer(run, hw)
    table = hw.tp_layer.get(table_dtype(run), {})
    rows = [r for r in hw.tp_layer_rows(table_dtype(run), run.world) if r[0] == run.t and r[3] == run.model.seq]
    if run.t == 1 or run.sequence_parallel or not rows:
        return forward, backward, layer
    measured_with = int(hw.ranks_measured(run.world, table))
    full = run.recompute == "full"

    def residual(row: Sequence[float]) -> list[float]:
        grid = grid_model(run, int(row[1]), int(row[2]), int(row[3]), int(row[4]), run.model.vocab)
        # the table is the eager layer's: its residual over the eager price, added to a compiled run's price too
        grid = replace(grid, t=run.t, p=max(1, measured_with // run.t), recompute="full" if full else "none",
                       compiled=False)
        f, b, _ = _priced_tp_layer(grid, hw)
        return [(row[7] if full else row[5]) - f, (row[8] if full else row[6]) - b]

    missed = interpolate(rows, (1, 4), (run.model.hidden, run.tokens), residual)
    if missed is None:
        return forward, backward, layer
    share = core_share(run, hw, table)
    return max(0.0, forward + missed[0] * share), max(layer.weight, backward + missed[1] * share), layer


def cp_layer_seconds(run: LocalLayout, hw: HardwareProfile, block_s: float) -> tuple[float, float]:
    """Exposed context-parallel seconds of one layer and microbatch, (forward, backward) (``context.cp_exposed``):
    a ring hop of one key/value block (a pair's message), or the all-gathers of k and v over cp; ``block_s``: one
    block's attention, which hides a hop where communication runs beside compute (not on a CPU)."""
    if run.cp == 1:
        return 0.0, 0.0
    kv = kv_block_bytes(run.micro_batch, run.model.seq, run.cp, run.kv_features, COMPUTE_BYTES[run.precision])
    if run.cp_comm == "ring":  # a shift: each rank sends its block on and receives the previous one at once
        exchange = hw.busy_cost("exchange", run.world)
        comm = exchange.time(kv) if exchange is not None else _comm(run, hw, "p2p", 2, kv)
    else:  # k and v gathered one after the other
        comm = 2 * _comm(run, hw, "all_gather", run.cp, allgather_bytes(run.cp * kv / 2, run.cp))
    hidden = block_s if hw.overlaps_compute else 0.0  # on a CPU a hop costs its time beside the block's
    return cp_exposed(run.cp, run.cp_comm, "none", comm, hidden)  # a recomputed forward: priced with it


def _all_to_all(run: LocalLayout, hw: HardwareProfile, sent: float) -> float:
    """Seconds of an expert all-to-all in which each rank sends ``sent`` bytes: over two ranks a pair's exchange
    (the busy p2p fit), over more the all-gather fit of the ep group (the same bytes leave each rank)."""
    return _comm(run, hw, "p2p" if run.ep == 2 else "all_gather", run.ep, sent)


def moe_stage_seconds(run: LocalLayout, hw: HardwareProfile, stage: int) -> tuple[int, MoESeconds | None]:
    """(MoE layers of ``stage``, what each adds over a dense layer: ``costmodel.moe.moe_layer_seconds`` on this
    profile; None for a dense stage). ``simulate`` draws its all-to-alls inside the F and B boxes."""
    n = moe_layers_of(run, stage)
    if not n or run.moe is None:
        return 0, None
    m, ranks = run.model, min(run.world, hw.devices_per_node)
    latency = (hw.op_latency(ranks) or 0.0) * core_share(run, hw)
    mlp = layer_gemms(m, run.tokens, run.t)[2:]  # the SwiGLU's two GEMMs this layer does not have
    share = core_share(run, hw)
    return n, moe_layer_seconds(run.moe, run.tokens, m.hidden, run.t, run.ep, COMPUTE_BYTES[run.precision], mlp,
                                lambda a, b, c: matmul_seconds(run, hw, a, b, c) * share,
                                lambda x: _all_to_all(run, hw, x), latency)


def _stage_costs(run: LocalLayout, hw: HardwareProfile, stage: int) -> tuple[float, float, float]:
    """(forward, full backward, weight-gradient part) seconds of one microbatch through ``stage``: its layers'
    and ends' compute (``local_compute``), the runtime's cost per action, and the communication beside them."""
    layers = len(stage_layers(run, stage))
    f_layer, b_layer, layer = tp_layer_seconds(run, hw)  # compute and its tensor-parallel collectives; compute
    blocks = blockwise_seconds(run, hw)
    attention = (attention_seconds(run, hw) if blocks is None else blocks[0]) * core_share(run, hw)
    cp_f, cp_b = cp_layer_seconds(run, hw, attention / run.cp)
    _, ends = tp_collectives(run, stage)
    f_layer += cp_f
    b_layer += cp_b
    if run.recompute == "full":  # the forward's communication again (the tensor-parallel part is in b_layer)
        b_layer += cp_f
    elif run.recompute == "selective":
        b_layer += cp_f  # the core again: with cp its ring or gather too
    end = end_seconds(run, hw, stage)
    action = runtime_seconds(run, hw)[0]
    forward = layers * f_layer + end.forward + action
    backward = layers * b_layer + end.backward + action
    weight = layers * layer.weight + end.weight
    n_moe, moe = moe_stage_seconds(run, hw, stage)  # --- mixture of experts (costmodel.moe): in place of the MLP ---
    if moe is not None:
        f_moe = moe.forward + moe.a2a_forward
        forward += n_moe * f_moe
        backward += n_moe * (moe.dgrad + moe.wgrad + moe.a2a_backward + (f_moe if run.recompute == "full" else 0.0))
        weight += n_moe * moe.wgrad
    for op, phase, nbytes in ends:  # the embedding's, the head's and the cross entropy's
        if phase == "forward":
            forward += _tp_time(run, hw, op, nbytes)
        else:
            backward += _tp_time(run, hw, op, nbytes)
    copy = offload_seconds(run, hw, stage)
    if hw.device == "cpu":  # the copies are memcpys on the compute's own cores: on the step
        return forward + copy, backward + copy, weight
    # a GPU copies on a side stream while the stage computes: only what outlasts the compute shows
    return forward + max(0.0, copy - forward), backward + max(0.0, copy - backward), weight


def offload_seconds(run: LocalLayout, hw: HardwareProfile, stage: int) -> float:
    """Seconds of one microbatch's activation-offload copy of ``stage`` one way (to host in the forward, the same
    back for the backward): ``offloaded_bytes`` over the host link (``HardwareProfile.host_bytes_per_s``)."""
    nbytes = offloaded_bytes(run, stage)
    return nbytes / hw.host_bytes_per_s(min(run.world, hw.devices_per_node)) if nbytes else 0.0


def _hop(run: LocalLayout, hw: HardwareProfile) -> float:
    """Seconds of one point-to-point transfer of a microbatch's activations between pipeline ranks."""
    act = float(run.tokens * run.model.hidden * COMPUTE_BYTES[run.precision])  # a microbatch's s/cp tokens
    act /= run.t if run.sequence_parallel and run.t > 1 else 1
    return _comm(run, hw, "p2p", 2, act) if run.p > 1 else 0.0


def _rank_layers(run: LocalLayout) -> tuple[int, ...] | None:
    """``run.stage_layers`` (p·v entries) as p whole stages: the layers of each rank's chunks added up (a V
    schedule's rank d holds stages d and 2p − 1 − d; the others' the loop placement d, d + p, ...)."""
    if run.stage_layers is None or run.v == 1:
        return run.stage_layers
    v_shaped = run.schedule != "auto" and schedule_entry(run.schedule).chunks == 2
    placement = v_map(run.p) if v_shaped and run.v == 2 else loop_map(run.p, run.v)
    return tuple(sum(n for n, rank in zip(run.stage_layers, placement) if rank == r) for r in range(run.p))


def stage_costs(run: LocalLayout, hw: HardwareProfile) -> StageCosts:
    """Forward, input- and weight-gradient seconds of each of the p whole stages (v = 1) and one transfer's:
    what ``simulate.synthesis`` builds ``schedule auto`` from (a schedule with v chunks cuts each into v)."""
    whole = replace(run, v=1, stage_layers=_rank_layers(run))
    costs = [_stage_costs(whole, hw, s) for s in range(run.p)]
    per_stage = [kind_times(*c) for c in costs]
    forward, input_grad, weight_grad = (tuple(times[kind] for times in per_stage) for kind in (Kind.F, Kind.I, Kind.W))
    return StageCosts(forward, input_grad, weight_grad, _hop(run, hw))


def layout_schedule(run: LocalLayout, hw: HardwareProfile) -> Schedule:
    """The schedule ``run`` executes: its generator's, or for ``auto`` the fastest ``simulate.synthesis`` builds
    from these stage costs with v = ``run.v`` and at most ``run.memory_limit`` held (0: any; ValueError if none fits)."""
    if run.schedule != "auto":
        return get_schedule(run.schedule, ranks=run.p, microbatches=run.microbatches, chunks=run.v,
                            costs=stage_costs(run, hw).per_kind())
    return auto_schedule(run, hw, (run.v,))[0]


def auto_schedule(run: LocalLayout, hw: HardwareProfile, chunks: tuple[int, ...] = (1, 2)) -> tuple[Schedule, Timeline]:
    """``schedule auto`` for ``run``: the fastest ``simulate.synthesis`` builds from these stage costs within
    ``run.memory_limit`` (0: any), synthesised for each v of ``chunks`` apart (each cached: ``layout_schedule`` asks
    for the winner's v again), ties to the smaller v. ValueError naming the least limit when none fits."""
    costs, limit = stage_costs(run, hw), run.memory_limit or None
    found = []
    for v in chunks:
        try:
            found.append(synthesize(run.p, run.microbatches, costs, limit, (v,)))
        except ValueError:
            continue
    if not found:
        synthesize(run.p, run.microbatches, costs, limit, tuple(chunks))  # raises, naming the least limit
    return min(found, key=lambda pair: pair[1].step_time)


def _timeline(run: LocalLayout, hw: HardwareProfile) -> tuple[Schedule, list[tuple[float, float, float]],
                                                           list[tuple[float, float, float]], Timeline]:
    """The run's schedule timed by the simulator with the priced actions: (schedule, stage costs, ZeRO times,
    timeline in seconds)."""
    schedule = layout_schedule(run, hw)
    costs = [_stage_costs(run, hw, s) for s in range(run.stages)]
    per_stage = [kind_times(*c) for c in costs]
    durations = {kind: [times[kind] for times in per_stage] for kind in KINDS}
    dp_stage = [_dp_times(run, hw, s) for s in range(run.stages)]
    tp_sync = [_tp_time(run, hw, "all_reduce", tp_grad_sync(run, s)) if tp_grad_sync(run, s) else 0.0
               for s in range(run.stages)]
    if run.zero >= 2:  # every backward (W when split) reduce-scatters; ZeRO-3 gathers before F, B and I
        again = run.zero == 3 and run.reshard
        for s, (scatter, gather, _) in enumerate(dp_stage):
            scatter += tp_sync[s]  # the tensor-parallel sum runs first, on each backward's full buffer
            durations[Kind.F][s] += gather if again else 0.0
            durations[Kind.B][s] += scatter + (gather if again else 0.0)
            durations[Kind.I][s] += gather if again else 0.0
            durations[Kind.W][s] += scatter
    hop = _hop(run, hw)
    transfer = [0.0] + [hop if schedule.stage_to_rank[s] != schedule.stage_to_rank[s - 1] else 0.0
                        for s in range(1, schedule.num_stages)]
    comm = {kind: [0.0] * run.stages for kind in KINDS}  # the expert all-to-alls an overlapped F&B pair hides
    for s in range(run.stages if hw.device != "cpu" else 0):  # a CPU runs a pair's halves one after the other
        n, sec = moe_stage_seconds(run, hw, s)
        if sec is not None:
            redo = sec.a2a_forward if run.recompute == "full" else 0.0  # the recomputed forward's, in the backward
            comm[Kind.F][s] = n * sec.a2a_forward
            comm[Kind.B][s] = comm[Kind.I][s] = n * (sec.a2a_backward + redo)
    starts, ends = replay_times(schedule, durations, transfer, comm)
    return schedule, costs, dp_stage, Timeline(schedule.actions, starts, ends, schedule)


def predicted_timeline(run: LocalLayout, hw: HardwareProfile) -> Timeline:
    """The pipeline ``predict_local`` times, in ms, with each MoE layer's expert all-to-alls inside its F and
    B (I) boxes (``Timeline.inner``, placed by ``costmodel.moe.moe_spans`` at the lengths priced here)."""
    schedule, _, _, tl = _timeline(run, hw)
    moe = set(run.moe.layers(run.model.layers)) if run.moe is not None else set()
    inner: list[list[tuple[str, float, float]]] = [[] for _ in tl.actions]
    for d, actions in enumerate(tl.actions):
        for a, s, e in zip(actions, tl.starts[d], tl.ends[d]):
            _, sec = moe_stage_seconds(run, hw, a.stage)
            if sec is None or a.kind is Kind.W:
                continue
            flags = [i in moe for i in stage_layers(run, a.stage)]
            inner[d] += [("all-to-all", 1e3 * x, 1e3 * y) for x, y in
                         moe_spans(s, e, flags, sec, "F" if a.kind is Kind.F else "B", run.recompute == "full")]
    ms = [[1e3 * x for x in row] for row in tl.starts], [[1e3 * x for x in row] for row in tl.ends]
    return Timeline(tl.actions, *ms, schedule, unit="ms", inner=inner)


def predict_local(run: LocalLayout, hw: HardwareProfile) -> LocalPrediction:
    """Step time, bubble and rank 0's bytes of ``run`` on the machine ``hw`` describes."""
    schedule, costs, dp_stage, timeline = _timeline(run, hw)
    pipeline = timeline.step_time

    stages = schedule.stages_on(0)
    state = state_bytes(run, stages)
    per_rank = []
    for r in range(run.p):
        mine = schedule.stages_on(r)
        count = round(timeline.peak_held[r] * schedule.chunks)
        act = count * sum(activation_bytes(run, s) for s in mine) / len(mine)
        per_rank.append(sum(state_bytes(run, mine).values()) + act + _allocator(run, hw, mine))
    busiest = max(range(run.p), key=lambda r: per_rank[r])
    grads = state["gradients"]
    dp, g = 0.0, run.grad_ranks
    if g > 1 and run.zero == 1:  # each bucket reduce-scattered, then gathered after the update
        dp = sum(dp_stage[s][0] + dp_stage[s][2] for s in stages)
    elif g > 1 and run.zero >= 2:  # the gathers after the step (ZeRO-2), or the one per step (ZeRO-3, kept)
        dp = sum(dp_stage[s][2] + (dp_stage[s][1] if not run.reshard else 0.0) for s in stages)
    elif g > 1:
        dp = all_reduce_exposed(run, hw, stages, costs[stages[0]][1])
    if run.zero < 2:  # the partial gradients' tensor-parallel sum, once, after the last backward
        dp += sum(_tp_time(run, hw, "all_reduce", tp_grad_sync(run, s)) for s in stages if tp_grad_sync(run, s))
    optimizer = step_end_seconds(run, hw, optimizer_tensors(run, stages), grads, state["optimizer"]) + runtime_seconds(run, hw)[1]
    if run.world > 1 and not hw.step_end_measured:  # the norm's all-reduce; the stop agreement's all-gather of 6 fp64
        #                                              values (training.stopping); a step end measured whole has them
        optimizer += _comm(run, hw, "all_reduce", run.world, 8) + _comm(run, hw, "all_gather", run.world,
                                                                        allgather_bytes(48.0 * run.world, run.world))
    held = round(timeline.peak_held[0] * schedule.chunks)
    memory = {**state, "activations": held * sum(activation_bytes(run, s) for s in stages) / len(stages)}
    host = held * sum(offloaded_bytes(run, s) for s in stages) / len(stages)
    step = pipeline + dp + optimizer
    allocated = sum(memory.values()) + _allocator(run, hw, stages) if hw.device != "cpu" else 0.0
    return LocalPrediction(step, timeline.bubble, {"pipeline": pipeline, "dp": dp, "optimizer": optimizer},
                           memory, held, (busiest, per_rank[busiest]), host, allocated)


def _allocator(run: LocalLayout, hw: HardwareProfile, stages: list[int]) -> float:
    """What a GPU's allocator holds beyond state and counted activations on the rank holding ``stages``
    (``costmodel.allocator``); 0 on a CPU, priced as before."""
    if hw.device == "cpu":
        return 0.0
    return allocator_bytes(run, stages).peak()
