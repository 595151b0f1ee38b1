"""Which pipeline schedule ``modelpar plan``'s layout should run, and why (pure Python).

The layout search ranks (t, p, d, b, v, ...) with Megatron's closed form, the schedule the
published runs used (1F1B, interleaved at v > 1). For the chosen layout, ``plan_schedule`` then
times every schedule of the family and ``auto`` (``simulate.synthesis``) with the layout's own
stage costs — each device's layers and the output layer at the estimate's per-layer time, split
F : I : W as the passes split it (forward 1, input gradient 1 plus a full recomputation's forward,
weight gradient 1), the estimate's transfer — and keeps the fastest whose peak held activations
fit what the device's memory leaves after its training state, working buffers and reserve, in
microbatches of the device's whole layer share. ``why`` states the choice against the layout's
own schedule. The synthesis costs seconds beyond p·m = ``MAX_SYNTHESISED`` and the family's
V-Half search beyond ``MAX_SEARCHED``: above them the choice is skipped (said so).
"""

from __future__ import annotations

from dataclasses import dataclass

from modelpar.costmodel.assumptions import Assumptions
from modelpar.costmodel.estimate import (
    Estimate,
    ep_layer_time,
    layer_time,
    matmul_efficiency,
    output_layer_time,
    transfer_time,
)
from modelpar.costmodel.memory import activation_bytes_per_layer
from modelpar.costmodel.specs import ClusterSpec, ModelSpec
from modelpar.costmodel.stages import check_split
from modelpar.schedules.memory import peak_held
from modelpar.schedules.registry import get_schedule
from modelpar.simulate.synthesis import StageCosts, candidates, synthesize
from modelpar.simulate.tables import takes_chunks
from modelpar.simulate.timeline import Timeline

__all__ = ["MAX_SEARCHED", "MAX_SYNTHESISED", "ScheduleChoice", "choose_schedule", "plan_schedule"]

MAX_SYNTHESISED = 128  # p·m up to which auto is synthesised (K = 8, M = 16: about a second here)
MAX_SEARCHED = 512  # p·m up to which the family is timed


@dataclass(frozen=True)
class ScheduleChoice:
    """The schedule chosen within ``limit`` held microbatches per device, and the layout's own for comparison."""

    chosen: Timeline
    own: Timeline
    limit: float

    @staticmethod
    def _name(tl: Timeline) -> str:
        s = tl.schedule
        if s is None:
            return "?"
        name = "auto (synthesised)" if s.name == "auto" else s.name
        return name + (f" v={s.chunks}" if takes_chunks(s.name) else "")

    def why(self) -> str:
        """One sentence: the chosen schedule's bubble and held activations beside the layout's own schedule's."""
        c, o = self.chosen, self.own
        ch, oh = max(c.peak_held), max(o.peak_held)
        limit = f"limit {self.limit:.3g}" if self.limit != float("inf") else "no limit"
        if c.schedule == o.schedule:
            return (f"{self._name(c)}: no schedule of the family, nor auto, is faster within {ch:g} microbatches "
                    f"held per device ({limit})")
        memory = f"at the same memory ({ch:g} microbatches held per device)" if abs(ch - oh) < 1e-9 else \
            f"holding {ch:g} vs {oh:g} microbatches per device"
        fits = "" if oh <= self.limit + 1e-9 else f"; {self._name(o)} does not fit ({limit})"
        return (f"{self._name(c)}: {100 * c.bubble:.0f}% bubble vs {self._name(o)} {100 * o.bubble:.0f}% "
                f"{memory}, step {c.step_time / o.step_time - 1:+.1%}{fits}")


def choose_schedule(costs: StageCosts, microbatches: int, limit: float, own: tuple[str, int] = ("1f1b", 1),
                    synthesise: bool = True) -> ScheduleChoice:
    """The fastest of ``own`` (name, v), the family (v ≤ 2) and (``synthesise``) ``auto`` holding ≤ ``limit``
    microbatches per device, and ``own`` timed alike. ValueError naming the least limit any schedule meets
    when none fits."""
    k = costs.stages
    mine = costs.timeline(get_schedule(own[0], ranks=k, microbatches=microbatches,
                                       chunks=own[1] if takes_chunks(own[0]) else None, costs=costs.per_kind()))
    own_fits = max(mine.peak_held) <= limit + 1e-9
    if synthesise:
        try:
            best = synthesize(k, microbatches, costs, limit if limit != float("inf") else None)[1]
        except ValueError:
            if own_fits:
                return ScheduleChoice(mine, mine, limit)
            raise
        return ScheduleChoice(mine if own_fits and mine.step_time <= best.step_time else best, mine, limit)
    found: Timeline | None = mine if own_fits else None
    least = max(mine.peak_held)
    for s in candidates(k, microbatches, costs):
        if s.name == "auto":  # the named family comes first; the synthesised ones are not built
            break
        held = max(peak_held(s.actions, s.chunks))
        least = min(least, held)
        if held <= limit + 1e-9:
            tl = costs.timeline(s)
            if found is None or tl.step_time < found.step_time - 1e-12:
                found = tl
    if found is None:
        raise ValueError(f"memory limit must be >= {least:g} microbatches' activations per device, got {limit:g}")
    return ScheduleChoice(found, mine, limit)


def plan_schedule(model: ModelSpec, cluster: ClusterSpec, best: Estimate, a: Assumptions) -> ScheduleChoice | str:
    """The schedule choice for ``best``'s layout (see the module), or a line saying why none was made."""
    cfg, m = best.config, best.microbatches
    if cfg.p == 1:
        return "one pipeline stage: no schedule to choose"
    if cfg.p * m > MAX_SEARCHED:
        return f"not searched: p·m = {cfg.p * m} > {MAX_SEARCHED} (the simulator's search would take minutes)"
    if cfg.stage_layers is None and check_split(model.layers, cfg.p, 2, None):
        return f"not searched: {model.layers} layers do not fill 2 chunks on each of {cfg.p} devices"
    eff = matmul_efficiency(model, cluster, cfg, a)
    per_layer = sum(layer_time(model, cluster, cfg, a, eff)) + ep_layer_time(model, cluster, cfg, a)  # MoE all-to-alls
    logits = output_layer_time(model, cluster, cfg, a, eff)
    p, loads = cfg.p, best.rank_layers
    work = [model.layers / p * per_layer + logits / p if a.uniform_stages else
            loads[r] * per_layer + (logits if r == p - 1 else 0.0) for r in range(p)]
    passes = 3 + (cfg.recompute == "full")
    forward = tuple(w / passes for w in work)
    costs = StageCosts(forward, tuple(w - 2 * f for w, f in zip(work, forward)), forward,
                       transfer_time(model, cluster, cfg, a))
    coeffs = (model.act_sharded_coeff, a.flash_attention, model.act_replicated_coeff)
    per_microbatch = activation_bytes_per_layer(model.seq, cfg.micro_batch, model.hidden, model.heads, cfg.t,
                                                cfg.sequence_parallel, cfg.recompute, *coeffs) * max(loads)
    other = sum(v for k, v in best.memory.items() if k != "activations")
    limit = (best.memory_limit - other) / per_microbatch
    try:
        return choose_schedule(costs, m, limit, ("interleaved", cfg.v) if cfg.v > 1 else ("1f1b", 1),
                               synthesise=p * m <= MAX_SYNTHESISED)
    except ValueError as err:
        return f"none fits: {err}"
