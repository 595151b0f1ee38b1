"""The cost model's prediction for one ``modelpar train`` layout on a hardware profile: step time, bubble, bytes.

Each action of the run's own schedule is priced from the profile (``profiles.py``) — a layer's
GEMMs at their shapes (forward; input and weight gradient in the backward), attention at the
measured attention throughput, element-wise work as the bytes the layer keeps streamed twice,
the per-op dispatch latency, the tensor-parallel collectives (2 forward, 2 backward per layer;
sequence parallelism: all-gather + reduce-scatter) — and the schedule is timed by the simulator
(``modelpar.schedules.execute``) with those durations and the point-to-point cost per boundary.
Then the step's end: the data-parallel reduction (what the last backward cannot hide), the
gradient norm, and AdamW over this rank's state. Nothing is fitted: every number is the
profile's or counted. Memory is ``local_memory``'s exact per-rank figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from modelpar.costmodel.local_memory import COMPUTE_BYTES, LocalRun, activation_bytes, stage_tensors, state_bytes
from modelpar.costmodel.measured import layer_gemms
from modelpar.costmodel.profiles import HardwareProfile
from modelpar.formulas import allgather_bytes, allreduce_bytes
from modelpar.schedules import get_schedule
from modelpar.schedules.action import Kind
from modelpar.schedules.execute import execute
from modelpar.schedules.schedule import Schedule
from modelpar.simulate.synthesis import StageCosts, synthesize
from modelpar.simulate.timeline import Timeline

__all__ = ["PRICED_ZERO", "LocalPrediction", "auto_schedule", "predict_local", "run_schedule", "stage_costs"]

_OPS_FORWARD = 12  # dispatched ops of a layer's forward (norms, GEMMs, attention, activation, residuals, views)
PRICED_ZERO = (0, 1)  # ZeRO stages whose step this model prices (2 and 3 reduce or gather every microbatch)
_OPS_STEP = 40  # per step: gradient norm, clipping, the loss all-gather, AdamW's foreach kernels, zeroing


@dataclass(frozen=True)
class LocalPrediction:
    """Predicted step of one layout: seconds, the pipeline bubble, and the busiest rank's bytes."""

    step_time_s: float
    bubble: float  # idle share of the pipeline (the simulator's, with these costs)
    time: dict[str, float]  # pipeline, dp (exposed), optimizer
    memory: dict[str, float] = field(default_factory=dict)  # rank 0: parameters, gradients, optimizer, activations
    peak_held: int = 0  # microbatch-chunks rank 0 holds at its peak (F until B or I)
    busiest: tuple[int, float] = (0, 0.0)  # (pipeline rank, bytes) of the rank holding the most

    @property
    def memory_bytes(self) -> float:
        """Bytes on the most loaded rank (training state and held activations)."""
        return self.busiest[1]

    def as_dict(self) -> dict[str, object]:
        return {"step_time_s": self.step_time_s, "bubble": self.bubble, "time_s": dict(self.time),
                "memory_bytes": dict(self.memory), "peak_held": self.peak_held,
                "busiest_rank": self.busiest[0], "busiest_bytes": self.busiest[1]}


def _dtype(run: LocalRun) -> str:
    return {"fp32": "fp32", "bf16": "bf16", "fp64": "fp64"}[run.precision]


def _matmul(run: LocalRun, hw: HardwareProfile, m: int, n: int, k: int) -> float:
    """Seconds of x[m×k]·w[k×n] at the profile's throughput for the run's dtype and rank count."""
    ranks = min(run.world, hw.devices_per_node)
    tflops = hw.matmul_tflops(m, n, k, _dtype(run), ranks) or hw.matmul_tflops(m, n, k, None, ranks)
    return 2.0 * m * n * k / ((tflops or hw.peak_tflops[hw.dtype]) * 1e12)


def _collective(hw: HardwareProfile, op: str, group: int, nbytes: float) -> float:
    cost = hw.collective(op, group)
    if cost is not None:
        return cost.time(nbytes)
    return nbytes / (hw.intra_node_gbps * 1e9)


def _stage_costs(run: LocalRun, hw: HardwareProfile, stage: int) -> tuple[float, float, float]:
    """(forward, full backward, weight-gradient part) seconds of one microbatch through ``stage``."""
    m, t = run.model, run.t
    ranks = min(run.world, hw.devices_per_node)
    e = COMPUTE_BYTES[run.precision]
    tokens = run.micro_batch * m.seq
    latency = hw.op_latency(ranks) or 0.0
    stream = activation_bytes(run, stage) * 2 / hw.elementwise_bytes_per_s(ranks)  # written, then read back
    fwd = dgrad = wgrad = 0.0
    layers = m.layers // run.stages
    for mm, n, k in layer_gemms(m, tokens, t):
        fwd += _matmul(run, hw, mm, n, k)
        dgrad += _matmul(run, hw, mm, k, n)
        wgrad += _matmul(run, hw, k, n, mm)
    attention_flops = 4.0 * run.micro_batch * m.seq * m.seq * m.hidden / t
    attention = 3 * attention_flops / ((hw.attention_tflops(_dtype(run), ranks) or hw.peak_tflops[hw.dtype]) * 1e12)
    tp = 0.0
    if t > 1:
        act = tokens * m.hidden * e
        if run.sequence_parallel:
            tp = _collective(hw, "all_gather", t, allgather_bytes(act, t)) + \
                _collective(hw, "reduce_scatter", t, allgather_bytes(act, t))
        else:
            tp = _collective(hw, "all_reduce", t, allreduce_bytes(act, t))
        tp *= 2  # per direction: after attention and after the MLP (g), before them in the backward (f)
    f_layer = fwd + attention / 3 + tp + _OPS_FORWARD * latency
    b_layer = dgrad + wgrad + 2 * attention / 3 + tp + 2 * _OPS_FORWARD * latency
    if run.recompute == "full":
        b_layer += f_layer
    elif run.recompute == "selective":
        b_layer += attention / 3
    forward, backward, weight = layers * f_layer, layers * b_layer, layers * wgrad
    if stage == run.stages - 1:  # the head's logits GEMM, its two backward GEMMs, the cross entropy
        head = _matmul(run, hw, tokens, m.vocab // t, m.hidden)
        forward += head + 4 * latency
        backward += 2 * head + 8 * latency
        weight += head
    forward += stream / 2
    backward += stream / 2
    return forward, backward, weight


def _hop(run: LocalRun, hw: HardwareProfile) -> float:
    """Seconds of one point-to-point transfer of a microbatch's activations between pipeline ranks."""
    act = float(run.micro_batch * run.model.seq * run.model.hidden * COMPUTE_BYTES[run.precision])
    act /= run.t if run.sequence_parallel and run.t > 1 else 1
    return _collective(hw, "p2p", 2, act) if run.p > 1 else 0.0


def stage_costs(run: LocalRun, hw: HardwareProfile) -> StageCosts:
    """Forward, input- and weight-gradient seconds of each of the p whole stages (v = 1) and one transfer's:
    what ``simulate.synthesis`` builds ``schedule auto`` from (a schedule with v chunks cuts each into v)."""
    whole = replace(run, v=1)
    costs = [_stage_costs(whole, hw, s) for s in range(run.p)]
    return StageCosts(tuple(c[0] for c in costs), tuple(c[1] - c[2] for c in costs), tuple(c[2] for c in costs),
                      _hop(run, hw))


def run_schedule(run: LocalRun, hw: HardwareProfile) -> Schedule:
    """The schedule ``run`` executes: its generator's, or for ``auto`` the fastest ``simulate.synthesis`` builds
    from these stage costs with v = ``run.v`` and at most ``run.memory_limit`` held (0: any; ValueError if none fits)."""
    if run.schedule != "auto":
        return get_schedule(run.schedule, stages=run.p, microbatches=run.microbatches, chunks=run.v)
    return auto_schedule(run, hw, (run.v,))[0]


def auto_schedule(run: LocalRun, hw: HardwareProfile, chunks: tuple[int, ...] = (1, 2)) -> tuple[Schedule, Timeline]:
    """``schedule auto`` for ``run``: the fastest ``simulate.synthesis`` builds from these stage costs within
    ``run.memory_limit`` (0: any), synthesised for each v of ``chunks`` apart (each cached: ``run_schedule`` asks
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


def predict_local(run: LocalRun, hw: HardwareProfile) -> LocalPrediction:
    """Step time, bubble and rank 0's bytes of ``run`` on the machine ``hw`` describes."""
    schedule = run_schedule(run, hw)
    costs = [_stage_costs(run, hw, s) for s in range(run.stages)]
    durations = {Kind.F: [c[0] for c in costs], Kind.B: [c[1] for c in costs],
                 Kind.I: [c[1] - c[2] for c in costs], Kind.W: [c[2] for c in costs]}
    hop = _hop(run, hw)
    transfer = [0.0] + [hop if schedule.stage_to_device[s] != schedule.stage_to_device[s - 1] else 0.0
                        for s in range(1, schedule.num_stages)]
    starts, ends = execute(schedule, durations, transfer)
    timeline = Timeline(schedule.actions, starts, ends, schedule)
    pipeline = timeline.step_time

    stages = schedule.stages_on(0)
    state = state_bytes(run, stages)
    ranks = min(run.world, hw.devices_per_node)
    per_rank = []
    for r in range(run.p):
        mine = schedule.stages_on(r)
        count = round(timeline.peak_activations[r] * schedule.chunks)
        act = count * sum(activation_bytes(run, s) for s in mine) / len(mine)
        per_rank.append(sum(state_bytes(run, mine).values()) + act)
    busiest = max(range(run.p), key=lambda r: per_rank[r])
    grads = state["gradients"]
    dp = 0.0
    if run.d > 1:
        if run.zero:
            dp = _collective(hw, "reduce_scatter", run.d, allgather_bytes(grads, run.d)) + \
                _collective(hw, "all_gather", run.d, allgather_bytes(grads, run.d))
        else:
            dp = _collective(hw, "all_reduce", run.d, allreduce_bytes(grads, run.d))
        if run.overlap and not run.zero:  # reduced during the last backward; what outlasts it is exposed
            dp = max(0.0, dp - costs[stages[0]][1])
    latency = hw.op_latency(ranks) or 0.0
    norm = grads / hw.elementwise_bytes_per_s(ranks) + (_collective(hw, "all_reduce", run.world, 8) if run.world > 1 else 0)
    adamw = 7 * state["optimizer"] / 2 / hw.elementwise_bytes_per_s(ranks)  # read g, w, m, v; write w, m, v
    optimizer = norm + adamw + _OPS_STEP * latency
    held = round(timeline.peak_activations[0] * schedule.chunks)
    memory = {**state, "activations": held * sum(activation_bytes(run, s) for s in stages) / len(stages)}
    step = pipeline + dp + optimizer
    return LocalPrediction(step, timeline.bubble, {"pipeline": pipeline, "dp": dp, "optimizer": optimizer},
                           memory, held, (busiest, per_rank[busiest]))


def rank_parameters(run: LocalRun, stages: list[int]) -> int:
    """Parameters (elements) a rank holding ``stages`` has: what ``TrainResult.parameters_here`` counts."""
    return sum(x.numel for s in stages for x in stage_tensors(run, s))
