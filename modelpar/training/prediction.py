"""Predicted vs measured for every run: the cost model's figures for the run's own layout, and the bytes it holds.

``local_run`` states a TrainConfig as the cost model's ``LocalLayout``; ``predict_run`` prices it on a
hardware profile (``--hardware``, which ``modelpar train`` fills from ``calibrate.cache``; else the nominal
``CPU_DEFAULT``, whose step time the summary never shows); the ranks measure what autograd
keeps (``modelpar.training.saved.saved_bytes``); ``compare`` lays the two side by side with the error;
``summary_rows`` writes them into the summary and ``metrics.jsonl``. ``run_schedule`` is the schedule a
run executes: with ``schedule auto`` the one ``simulate.synthesis`` builds from this cost model's stage
times under ``memory_limit``. It is built once, where the run starts, and shipped to the ranks
(``modelpar.training.start``).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from modelpar.costmodel.local import LocalPrediction, auto_schedule, layout_schedule, predict_local
from modelpar.costmodel.local_memory import LocalLayout, activation_bytes, batch_view_bytes
from modelpar.costmodel.presets import CPU_DEFAULT, PROFILES
from modelpar.costmodel.profiles import HardwareProfile, busy_warning, load_profile, profile_source
from modelpar.costmodel.specs import PLANNED_RECOMPUTE
from modelpar.schedules import Schedule
from modelpar.schedules.memory import peak_held_bytes
from modelpar.training.config import TrainConfig

__all__ = ["compare", "held_activation_bytes", "held_parameter_bytes", "local_run", "predict_run", "resolve_schedule",
           "run_schedule", "summary_rows"]


def local_run(cfg: TrainConfig, hw: HardwareProfile | None = None) -> LocalLayout:
    """The cost model's description of ``cfg``'s layout (the trainer's buckets and precision included); for a GPU
    profile ``hw`` with the ops its model dispatches (``training.dispatch.count_dispatch``, cached: a GPU's
    actions are paced by the host or the kernels, ``costmodel.local_compute.paced``)."""
    elements = max(1, int(cfg.bucket_mb * 2**20) // cfg.param_dtype.itemsize)
    ops = None
    if hw is not None and hw.device != "cpu":
        from modelpar.training.dispatch import count_dispatch

        ops = count_dispatch(cfg.model, cfg.precision, cfg.loss_chunk > 0)
    return LocalLayout(cfg.model.spec(), t=cfg.tp, p=cfg.pp, d=cfg.dp, schedule=cfg.schedule, v=cfg.chunks,
                       microbatches=cfg.microbatches, batch=cfg.batch_size, recompute=cfg.recompute,
                       sequence_parallel=cfg.sequence_parallel, zero=cfg.zero, precision=cfg.precision,
                       bucket_elements=elements, overlap=cfg.overlap_grad_reduce and cfg.dp * cfg.cp > 1,
                       reshard=cfg.reshard_after_forward, memory_limit=cfg.memory_limit, cp=cfg.cp,
                       cp_comm=cfg.cp_comm, moe=cfg.model.moe_spec(), ep=cfg.ep, chunked_loss=cfg.loss_chunk > 0,
                       offload=cfg.offload_activations, stage_layers=cfg.stage_layers, ops=ops,
                       compiled=cfg.compile and cfg.compile_backend == "inductor")


def held_activation_bytes(cfg: TrainConfig, schedule: Schedule) -> list[float]:
    """Per pipeline rank: the peak bytes of activations ``schedule`` holds (the simulator's count, F until B or W,
    a microbatch of stage s weighing the cost model's ``activation_bytes``, less its share of the batch's ids and
    targets, which count whole while any microbatch of s is held: ``batch_view_bytes``): what
    ``TrainResult.peak_held_bytes`` measures."""
    run = local_run(cfg)
    stages = range(schedule.num_stages)
    views = [batch_view_bytes(run, s) for s in stages]
    own = [activation_bytes(run, s) - views[s][0] for s in stages]
    return peak_held_bytes(schedule.actions, own, [whole for _, whole in views])


def held_parameter_bytes(cfg: TrainConfig, result: Any) -> int:
    """The parameter bytes a rank keeps between steps, as the cost model counts them: all of its parameters,
    or under ZeRO-3 its range of every bucket (``TrainResult.parameter_bytes``, padding included)."""
    return result.parameter_bytes if cfg.zero == 3 else result.parameters_here * cfg.param_dtype.itemsize


def profile_of(cfg: TrainConfig) -> HardwareProfile:
    """The run's ``hardware``: a named GPU (``presets.PROFILES``) or a profile file (checked: same torch,
    well formed); without one the nominal CPU default."""
    if not cfg.hardware:
        return CPU_DEFAULT
    return PROFILES.get(cfg.hardware.lower()) or load_profile(cfg.hardware)


def _chunks_allowed(cfg: TrainConfig) -> tuple[int, ...]:
    """The v (1, 2) ``cfg``'s model and split allow: what ``schedule auto`` may choose from. Without a
    ``stage_layers``, v only where the layers fill the p·v chunks evenly (the synthesis cuts a stage's costs
    evenly), as the planner's ``costmodel.local_search`` allows."""
    allowed = []
    for v in (1, 2):
        if cfg.stage_layers is None and cfg.model.layers % (cfg.pp * v):
            continue
        try:
            replace(cfg, chunks=v).check()
            allowed.append(v)
        except ValueError:
            pass
    return tuple(allowed)


def run_schedule(cfg: TrainConfig) -> Schedule:
    """The schedule ``cfg`` runs: its named generator's, or with ``schedule auto`` the synthesised one (v = chunks)."""
    profile = profile_of(cfg)
    return layout_schedule(local_run(cfg, profile), profile)


def resolve_schedule(cfg: TrainConfig) -> tuple[TrainConfig, str | None]:
    """``cfg`` with ``chunks`` of the schedule ``auto`` builds, and the line that states it (None: a named one).

    ``schedule auto``: the fastest schedule whose held activations fit ``memory_limit`` (0: any), timed with the
    cost model's stage times on the run's hardware, of v = 1 or 2 as the config allows. A limit below what any
    schedule holds is a ValueError naming the smallest that works.
    """
    if cfg.schedule != "auto":
        return cfg, None
    profile = profile_of(cfg)
    schedule, tl = auto_schedule(local_run(cfg, profile), profile, _chunks_allowed(cfg))
    out = replace(cfg, chunks=schedule.chunks)
    pred = predict_run(out)
    what = "synthesised by the list scheduler" if schedule.name == "auto" else "the family's best"
    limit = f"limit {cfg.memory_limit:g}" if cfg.memory_limit else "no limit"
    line = (f"schedule auto: {schedule.name} ({what}, v={schedule.chunks}) for p={cfg.pp}, m={cfg.microbatches} "
            f"on {profile_of(cfg).name}; predicted step {1e3 * pred.step_time_s:,.1f} ms, bubble "
            f"{100 * pred.bubble:.1f}%, held activations {max(tl.peak_held):g} microbatches' worth per "
            f"device ({limit})")
    return out, line


def predict_run(cfg: TrainConfig, profile: HardwareProfile | None = None) -> LocalPrediction:
    """The cost model's prediction for ``cfg`` (rank 0's bytes; no activations for an unplanned recomputation)."""
    profile = profile or profile_of(cfg)
    pred = predict_local(local_run(cfg, profile), profile)
    if cfg.recompute not in PLANNED_RECOMPUTE:  # every-k and sqrt checkpointing: not modelled
        pred.memory.pop("activations", None)
    return pred


def compare(predicted: LocalPrediction, measured: dict[str, float | None]) -> dict[str, dict[str, float | None]]:
    """name -> {predicted, measured, error} for step time, bubble and rank 0's bytes: the error is predicted /
    measured − 1, for the bubble (itself a fraction of the step, often near 0) predicted − measured."""
    pairs = {"step_time_s": predicted.step_time_s, "bubble": predicted.bubble,
             **{f"{k}_bytes": v for k, v in predicted.memory.items()}}
    if predicted.host_bytes or measured.get("offloaded_bytes"):  # --offload-activations: what went to host memory
        pairs["offloaded_bytes"] = predicted.host_bytes
    rows: dict[str, dict[str, float | None]] = {}
    for name, value in pairs.items():
        got = measured.get(name)
        if name == "bubble":
            error = None if got is None else value - got
        else:
            error = None if got is None or not got else value / got - 1
        rows[name] = {"predicted": value, "measured": got, "error": error}
    return rows


def _cores_shared(cfg: TrainConfig, profile: HardwareProfile) -> str | None:
    """A warning when a CPU run has more local ranks than cores: the operating system then time-slices them, and
    the step time is the cost model's least certain prediction (docs/calibrate.md, ``--validate-local``)."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.dims.world_size))  # this node's ranks (torchrun sets it)
    cores = os.cpu_count() or 1
    if profile.device != "cpu" or ranks <= cores:
        return None
    return f"{ranks} ranks on {cores} cores: the step time is the least certain prediction (docs/calibrate.md)"


def step_time_caveats(cfg: TrainConfig, profile: HardwareProfile) -> list[tuple[str, str]]:
    """Why this run's predicted step time is less certain than usual, as summary rows under it: ranks sharing
    cores, a profile measured beside other work (``profiles.busy_warning``), a compiled run priced as eager."""
    rows = []
    shared = _cores_shared(cfg, profile)
    if shared:
        rows.append(("  cores shared", shared))
    busy = busy_warning(profile.cpu_busy)
    if busy:
        rows.append(("  profile", busy))
    if cfg.compile:
        rows.append(("  compiled", _compiled_caveat(cfg, profile)))
    return rows


def _compiled_caveat(cfg: TrainConfig, profile: HardwareProfile) -> str:
    """How a ``--compile`` run was priced: its layers from the profile's compiled table, or as the eager run."""
    from modelpar.costmodel.local_compute import compiled_measured

    if cfg.compile_backend != "inductor":
        return f"priced as the eager run: the profile times inductor's kernels, not {cfg.compile_backend}'s"
    if not compiled_measured(local_run(cfg), profile):
        return "priced as the eager run: the profile has no compiled layer (modelpar calibrate --compile measures it)"
    scope = "; the stage's ends as eager" if cfg.compile_scope == "stage" else ""
    return f"the layers priced from the profile's compiled layer (calibrate --compile){scope}"


def summary_rows(cfg: TrainConfig, result: Any, out: Path) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Predicted vs measured (step time, bubble, rank 0's bytes) as summary rows, also in metrics.jsonl."""
    from modelpar.training.metrics import append_record

    profile = profile_of(cfg)
    times = result.step_times[1:] or result.step_times
    measured = {"step_time_s": statistics.median(times) if times else None, "bubble": result.bubble_measured,
                "parameters_bytes": held_parameter_bytes(cfg, result), "gradients_bytes": result.gradient_bytes,
                "optimizer_bytes": result.optimizer_state_bytes, "activations_bytes": result.activation_bytes,
                "offloaded_bytes": result.offloaded_activation_bytes}
    rows = compare(predict_run(cfg, profile), measured)
    if not cfg.hardware:  # a nominal guess is never shown as a prediction: memory only (it needs no device)
        rows = {k: v for k, v in rows.items() if k.endswith("_bytes")}
    record = {"event": "prediction", "step": len(result.losses), "hardware": profile.name if cfg.hardware else None,
              **{f"{k}_{part}": v for k, row in rows.items() for part, v in row.items()}}
    append_record(out, record)

    def show(name: str, value: float | None) -> str:
        if value is None:
            return "-"
        if name == "step_time_s":
            return f"{1e3 * value:,.1f} ms"
        if name == "bubble":
            return f"{100 * max(value, 0.0):.1f}%"  # never below 0: the simulator's rounding can give -0.0
        return f"{value / 2**20:,.2f} MiB"

    lines = []
    for name, row in rows.items():
        error = "-" if row["error"] is None else f"{100 * row['error']:+.1f}{' points' if name == 'bubble' else '%'}"
        lines.append((f"predicted / measured {name.removesuffix('_bytes').removesuffix('_s').replace('_', ' ')}",
                      f"{show(name, row['predicted'])} / {show(name, row['measured'])} ({error})"))
    source = (f"{profile.name} ({profile_source(cfg.hardware, list(PROFILES))})" if cfg.hardware else
              "no profile: memory only, no step time (--no-calibrate; modelpar calibrate, then --hardware)")
    lines.insert(0, ("prediction from", source))
    if "step_time_s" in rows:
        lines[2:2] = step_time_caveats(cfg, profile)
    return lines, {"hardware": profile.name if cfg.hardware else None, "source": source, **rows}
