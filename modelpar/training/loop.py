"""The 3D-parallel training loop (§6): run on every rank of an initialised process group.

    for step in range(start, steps):
        inputs → first stage, labels → last stage          (modelpar.text.rank_batch; cp: this rank's tokens)
        PipelineRunner.step: schedule's F/B(/I/W) over p    (modelpar.pipeline)
        GradSync.finish: sp sums, tied-embedding sum, mean over dp × cp
        GradClip.clip: global norm over every shard
        StopController.agree: loss mean over replicas, and every rank's stop flags (one all-gather)
        AdamW.step (unless non-finite); report; eval; checkpoint; or stop on every rank at once

Everything every rank must agree on (the config checks; the checkpoint to resume from and its
compatibility, settled by rank 0 and broadcast) is decided before training starts, so bad input
raises the same ValueError on every rank.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from modelpar.checkpoint import CheckpointManager
from modelpar.schedules import Schedule
from modelpar.tensor_parallel import set_shape_checks
from modelpar.tensor_parallel.context_parallel import ContextParallel
from modelpar.text import open_corpus, prepare_on_rank0, rank_batch
from modelpar.training.config import TrainConfig
from modelpar.training.dp_comm import REDUCTIONS
from modelpar.training.expert_stats import ExpertStats
from modelpar.training.faults import nonfinite_hook, slow_init
from modelpar.training.optimizer import build_optimizer, measured_state_bytes, set_lr
from modelpar.training.parts import (
    apply_compile,
    apply_data_parallel,
    apply_float8,
    apply_offload,
    apply_pipeline,
    build_stages,
    computed_stages,
    stage_loss,
)
from modelpar.training.resume import fits, open_directory, resume_check
from modelpar.training.saved import saved_bytes
from modelpar.training.setup import release_rank, setup_rank
from modelpar.training.state import checkpoint_state, init_optimizer_state, run_meta
from modelpar.training.stopping import Stop, StopController, Verdict
from modelpar.training.telemetry import MEASURED_STEPS, STEP_FIELDS, StepTelemetry

__all__ = ["TrainResult", "lr_at", "train_rank"]

Reporter = Callable[[dict[str, Any]], None]


@dataclass
class TrainResult:
    """What a run did (the same on every rank, except ``bubble_*``, measured per pipeline group)."""

    start_step: int  # 0, or the step a resumed run started from
    losses: list[float] = field(default_factory=list)  # training loss of every step since step 0
    val: list[tuple[int, float]] = field(default_factory=list)  # (step, validation loss)
    step_times: list[float] = field(default_factory=list)  # seconds, this run's steps
    # of each step, the seconds outside the pipeline's runner and the gradient sync's finish: the batch, the norm and
    # clipping, the stop agreement, the optimizer, the zeroing (what ``modelpar calibrate`` measures as the step end)
    step_end_times: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    tokens_per_step: int = 0
    bubble_measured: float | None = None  # idle share of the pipeline in the last steps
    num_parameters: int = 0
    flops_per_token: float = 0.0  # model FLOPs per trained token (ModelConfig.flops_per_token)
    device_name: str = "cpu"  # what the ranks computed on (torch.cuda.get_device_name), for the MFU
    parameters_here: int = 0  # elements of this rank's parameters (its tp / pp part; a tied copy included)
    optimizer_state_bytes: int = 0  # this rank's AdamW moments (1/d of them under ZeRO >= 1), measured from the tensors
    optimizer_tensors: int = 0  # the tensors this rank's AdamW steps (its parameters; under ZeRO their parts in its ranges)
    gradient_bytes: int = 0  # this rank's gradient buffers kept between steps (its ranges under ZeRO >= 2), measured
    parameter_bytes: int = 0  # this rank's parameter buffers kept between steps (its ranges under ZeRO-3), measured
    peak_buffer_bytes: int = 0  # ZeRO >= 2: the most bytes of full-size buckets (gathered parameters, gradients
    #                             being reduced) held at once in a step; 0 otherwise (they are all kept)
    buckets: int = 0  # this rank's gradient buckets (one data-parallel collective each)
    dp_bytes_sent: float = 0.0  # bytes this rank sent in the last step's data-parallel collectives (ring)
    all_gather_bytes: float = 0.0  # of which parameter all-gathers
    reduce_scatter_bytes: float = 0.0  # of which gradient reduce-scatters
    gathers_per_step: int = 0  # ZeRO-3: buckets gathered in the last step
    exposed_gather: float | None = None  # ZeRO-3: s the compute waited for gathers per step (median of the last steps)
    message_bytes: list[float] | None = None  # the pipeline's message into each stage (PipelineRunner.message_bytes)
    exposed_reduction: float | None = None  # s of gradient reduction past the last compute action (median of the
    #                                         last steps, the device that waits longest); the rest overlapped
    schedule: Any = None  # the Schedule this rank ran
    timelines: list[Any] = field(default_factory=list)  # the last measured steps' Timelines of this rank's pipeline
    unigram_baseline: float = 0.0  # nats/token on validation, see Corpus.unigram_baseline
    tokens_per_byte: float = 1.0  # of the validation text: nats/token × tokens_per_byte / ln 2 = bits/byte
    skipped_steps: int = 0  # steps whose update was skipped for a non-finite value (skip_nonfinite)
    saved_bytes: dict[int, int] = field(default_factory=dict)  # stage -> bytes autograd keeps per microbatch here
    offloaded_bytes: dict[int, int] = field(default_factory=dict)  # stage -> bytes moved to host per microbatch
    offload_peak_bytes: int | None = None  # most bytes in host memory at once during the steps (offload; None: off)
    offload_seconds: float | None = None  # seconds this rank spent copying, both ways, all steps (a CPU; a GPU: 0)
    peak_held: int = 0  # most microbatch-chunks this rank held at once in the last step (F until B or W)
    peak_held_bytes: int | None = None  # most bytes autograd held for backward at once in the first step, measured
    #                                     (``ActivationMeter`` around every action; None: --compile)
    expert_imbalance: float | None = None  # MoE: the largest max/mean tokens per expert of any layer and step
    stop: Stop | None = None  # why and where the run stopped early (None: it ran to the end or exit_after)
    compile_seconds: float | None = None  # --compile: seconds this rank spent compiling (None: not compiled)
    save_stalls: list[float] = field(default_factory=list)  # s each checkpoint save held this rank's training
    save_writes: list[float] = field(default_factory=list)  # s from each completed save's start to its completion
    config: Any = None  # the TrainConfig the ranks trained: the data's vocabulary and the resolved schedule in it

    @property
    def timeline(self) -> Any:
        """The last measured step's Timeline of this rank's pipeline (with its dp collectives), or None."""
        return self.timelines[-1] if self.timelines else None

    @property
    def bubble_simulated(self) -> float | None:
        """The simulator's bubble with the measured action costs of ``timelines`` (computed when a report asks:
        the loop does not simulate)."""
        if not self.timelines:
            return None
        from modelpar.pipeline.measure import measured_durations, simulate_measured

        return simulate_measured(self.schedule, measured_durations(self.timelines)).bubble

    @property
    def bubble_ideal(self) -> float | None:
        """The simulator's bubble of ``schedule`` with equal stages, F = 1, B = 2."""
        if self.schedule is None:
            return None
        from modelpar.simulate import simulate

        return simulate(self.schedule).bubble

    def fields(self, names: tuple[str, ...]) -> dict[str, Any]:
        """The named fields (and properties) by name: what the step event and summary.json carry."""
        return {name: getattr(self, name) for name in names}

    @property
    def peak_state_bytes(self) -> int:
        """Parameters, gradients and AdamW state at this rank's peak: what it keeps plus the full buckets."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes + self.peak_buffer_bytes

    @property
    def activation_bytes(self) -> float | None:
        """Activations held at this rank's peak: peak microbatch-chunks × the mean saved bytes of its stages."""
        if not self.saved_bytes or not self.peak_held:
            return None
        return self.peak_held * sum(self.saved_bytes.values()) / len(self.saved_bytes)

    @property
    def offloaded_activation_bytes(self) -> float | None:
        """Activations in host memory at this rank's peak (``--offload-activations``; None: off)."""
        if not self.offloaded_bytes or not self.peak_held:
            return None
        return self.peak_held * sum(self.offloaded_bytes.values()) / len(self.offloaded_bytes)

    @property
    def tokens_per_s(self) -> float:
        """Median throughput over this run's steps (the first, warm-up step excluded if possible)."""
        times = self.step_times[1:] or self.step_times
        return self.tokens_per_step / statistics.median(times) if times else 0.0

    def bits_per_byte(self, nats_per_token: float) -> float:
        """A validation loss in bits per byte of text, comparable across tokenizers."""
        return nats_per_token * self.tokens_per_byte / math.log(2)


# The result's fields summary.json carries under their own names (the step's, STEP_FIELDS, among them; beside the
# config and what the command derives).
SUMMARY_FIELDS = ("losses", "val", "tokens_per_s", "unigram_baseline", "bubble_measured", "bubble_simulated",
                  "bubble_ideal", "start_step", "tokens_per_byte", "num_parameters", "flops_per_token",
                  "skipped_steps", "compile_seconds", *STEP_FIELDS, "exposed_reduction", "peak_buffer_bytes", "gathers_per_step",
                  "exposed_gather", "message_bytes", "expert_imbalance", "offload_peak_bytes", "offload_seconds",
                  "save_stalls", "save_writes")


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine decay to lr/10 at ``steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def _global_mean(value: float | None, weight: float, device: torch.device) -> float:
    """Sum over all ranks of ``value * weight`` (ranks without a value contribute 0)."""
    t = torch.tensor([0.0 if value is None else value * weight], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item()


def _resume(cfg: TrainConfig, checkpoints: CheckpointManager | None, state: Any) -> tuple[int, list[float]]:
    """Load the checkpoint to resume from, if any (written at any split); return (step to start at, losses so far)."""
    path = checkpoints.choose(fits(cfg)) if checkpoints is not None and cfg.resume else None
    if checkpoints is None or path is None:
        return 0, []
    meta = checkpoints.load(path, state)
    return int(meta["step"]), [float(x) for x in meta["losses"]]


def _no_fault(step: int, params: list[torch.nn.Parameter]) -> None:
    """No gradient fault injected (``training.faults.nonfinite_hook``: tests put a NaN in one)."""


class _Run:
    """Everything one rank holds during training: its stages and their parts (``modelpar.training.parts``), the
    optimizer, the checkpoint state and the step's measurements (``StepTelemetry``)."""

    def __init__(self, cfg: TrainConfig, schedule: Schedule, report: Reporter | None,
                 checkpoints: CheckpointManager | None, stop: StopController) -> None:
        self.cfg, self.schedule, self.stop, self.checkpoints = cfg, schedule, stop, checkpoints
        self.rs = rs = setup_rank(cfg, schedule, cfg.timeout)
        self.corpus = open_corpus(cfg.data)
        self.context = ContextParallel(rs.cp_group, cfg.cp_comm)
        self.modules = build_stages(cfg, rs, schedule, self.context)
        self.offload = apply_offload(cfg, self.modules)
        apply_float8(cfg, self.modules, rs.device)  # before compiling: the float8 products are part of the graphs
        self.compile_clock = apply_compile(cfg, self.modules, schedule)
        self.experts = ExpertStats(cfg, self.modules, rs.tp_rank, rs.device)
        slow_init()
        self.fault = nonfinite_hook() or _no_fault
        if cfg.init_from is not None:
            from modelpar.hf import load_hf_shards

            for module in self.modules.values():
                load_hf_shards(module, cfg.init_from)
        self.loss_fn = stage_loss(cfg, rs, self.modules)
        self.runner = apply_pipeline(cfg, rs, schedule, self.modules, self.loss_fn)
        self.dp = apply_data_parallel(cfg, rs, schedule, self.modules, self.runner)
        self.optimizer = build_optimizer(cfg.zero, self.dp.sync, self.dp.comm, rs.grad_rank, cfg.lr, cfg.weight_decay)
        init_optimizer_state(self.optimizer)
        self.rng = torch.get_rng_state()
        self.state = checkpoint_state(cfg.model, self.modules, self.optimizer, self.rng)
        start, losses = _resume(cfg, checkpoints, self.state)
        torch.set_rng_state(self.rng)
        self.result = self._result(start, losses)
        if self.offload is not None:  # the peak in host memory from here on is the training steps'
            self.offload.reset_peak()
        self.first = rs.pp_rank == schedule.rank_of(0)
        self.last = rs.pp_rank == schedule.rank_of(schedule.num_stages - 1)
        # one rank per (replica, cp rank): the mean of the cp ranks' means over equally many tokens is the global mean
        self.loss_weight = 1.0 / (cfg.dp * cfg.cp) if (self.last and rs.tp_rank == 0) else 0.0
        self.emit = report if (report is not None and dist.get_rank() == 0) else None
        self.telemetry = StepTelemetry(self.result, self.dp, self.runner, self.experts, rs.device, self.emit,
                                       held_bytes=not cfg.compile)

    def _result(self, start: int, losses: list[float]) -> TrainResult:
        """The result before the first step: what this rank holds, measured from its tensors."""
        cfg, rs, sync = self.cfg, self.rs, self.dp.sync
        result = TrainResult(start, losses, tokens_per_step=cfg.tokens_per_step,
                             num_parameters=cfg.model.num_parameters(), flops_per_token=cfg.model.flops_per_token(),
                             device_name=torch.cuda.get_device_name(rs.device) if rs.device.type == "cuda" else "cpu",
                             parameters_here=sum(p.numel() for p in sync.params),
                             optimizer_state_bytes=measured_state_bytes(self.optimizer),
                             optimizer_tensors=sum(len(g["params"]) for g in self.optimizer.param_groups),
                             gradient_bytes=sync.gradient_bytes(), buckets=len(sync.buckets),
                             parameter_bytes=sync.parameter_bytes(), unigram_baseline=self.corpus.unigram_baseline(),
                             tokens_per_byte=self.corpus.tokens_per_byte)
        result.saved_bytes = saved_bytes(cfg, computed_stages(cfg, self.modules, self.schedule), self.loss_fn, cfg.tp,
                                         rs.device, self.offload, result.offloaded_bytes)
        return result

    def batch(self, split: str, index: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, y = self.corpus.batch(split, index, self.cfg.batch_size, self.cfg.model.seq_len, self.cfg.seed)
        if self.cfg.cp > 1:  # this rank's tokens of every sequence: chunks r and 2·cp−1−r
            mine = self.context.positions(x.shape[1] // self.cfg.cp)
            x, y = x[:, mine], y[:, mine]
        xi, yi = rank_batch(x, y, dp_rank=self.rs.dp_rank, dp=self.cfg.dp, first_stage=self.first,
                            last_stage=self.last)
        return tuple(None if t is None else t.to(self.rs.device) for t in (xi, yi))  # type: ignore[return-value]

    def step(self, step: int) -> Verdict:
        """Batch → runner → gradient sync → clip → agree → optimizer; every rank returns the same verdict."""
        t0, lr, sync = time.perf_counter(), lr_at(self.cfg, step), self.dp.sync
        xi, yi = self.batch("train", step)
        set_lr(self.optimizer, lr)
        sync.zero_grad()
        self.telemetry.begin()
        self.runner.step(xi, yi)
        moe = self.experts.take_step()  # collective when the model has experts
        self.fault(step, sync.grad_holders)  # tests only (modelpar.training.faults); nothing otherwise
        sync.finish()
        self.telemetry.computed()
        norm = self.dp.clipper.clip(self.cfg.clip)
        mine = float(self.runner.last_loss) if self.runner.last_loss is not None else None
        verdict = self.stop.agree(mine, self.loss_weight, norm, sync.grad_holders, self.rs.device)
        if verdict.update:
            self.optimizer.step()  # ZeRO-1/2: then the all-gather of the updated parameters
        self.dp.after_update()
        self.telemetry.record(step, lr, verdict.loss, norm, time.perf_counter() - t0, moe, self.cfg.tokens_per_step)
        return verdict

    def validate(self, step: int) -> None:
        total = 0.0
        for i in range(self.cfg.eval_batches):
            xi, yi = self.batch("val", i)
            loss = self.runner.evaluate(xi, yi)  # the schedule's forward half, same lowered communication
            total += _global_mean(None if loss is None else float(loss), self.loss_weight, self.rs.device) / self.cfg.eval_batches
        self.result.val.append((step, total))
        self.telemetry.after_evaluation()
        if self.emit:
            self.emit({"event": "eval", "step": step, "val_loss": total, "val_bpb": self.result.bits_per_byte(total)})

    def save(self, step: int, wait: bool = True) -> str | None:
        """Write the checkpoint of ``step`` (collective); return its path (None: no checkpoint_dir). With
        ``async_checkpoint`` and not ``wait``, it is written in the background and completed by the next save or
        ``finish_save``; the path returned is then the previous one's (None: none was in flight)."""
        if self.checkpoints is None:
            return None
        t0 = time.perf_counter()
        self.rng.copy_(torch.get_rng_state())
        meta = run_meta(self.cfg, step, self.result.losses)
        if self.cfg.async_checkpoint and not wait:
            path = self.checkpoints.save_async(step, self.state, meta)
        else:
            self.finish_save()
            path = self.checkpoints.save(step, self.state, meta)
        self.result.save_stalls.append(time.perf_counter() - t0)
        if path is not None:
            self._written()
        return None if path is None else str(path)

    def finish_save(self) -> None:
        """Complete a checkpoint being written in the background, if any (collective)."""
        if self.checkpoints is not None and self.checkpoints.finish() is not None:
            self._written()

    def _written(self) -> None:
        assert self.checkpoints is not None
        self.result.save_writes.append(self.checkpoints.write_seconds)
        self.stop.saved(self.checkpoints.write_seconds)  # the estimate for a save inside the preemption grace

    def close(self) -> None:
        """End what the run started: the data-parallel waiter, the hooks on the parameters (they hold the gradient
        sync, and through it the modules, buffers and groups, in a cycle the garbage collector cannot see through
        autograd's C++ side) and the process groups with their threads (a reused rank would keep them all)."""
        self.dp.close()
        if self.compile_clock is not None:
            self.compile_clock.stop()
            self.result.compile_seconds = self.compile_clock.seconds
        release_rank(self.rs)

    def stop_after(self, verdict: Verdict, step: int) -> Stop:
        """Stop at ``step`` as ``verdict`` says, on every rank: the checkpoint it asks for, then the one line."""
        if self.emit:
            self.emit({"event": "stopping", "step": step, "save": verdict.save})
        self.finish_save()  # a checkpoint in flight is completed: every rank is here
        written = self.save(step) if verdict.save else None
        latest = self.checkpoints.latest(checksums=False) if self.checkpoints is not None else None
        return self.stop.outcome(verdict, step, written, None if latest is None else str(latest))


def train_rank(cfg: TrainConfig, schedule: Schedule, report: Reporter | None = None) -> TrainResult:
    """Train on this rank with ``schedule``, resolved where the run started (``modelpar.training.train``); every
    rank of the default process group calls it with the same ``cfg`` and schedule.

    From here on Ctrl-C and the preemption signal stop every rank at a step boundary
    (``TrainResult.stop``; modelpar.training.stopping).
    """
    cfg = _with_schedule(cfg.check(dist.get_world_size()), schedule).check(dist.get_world_size())
    with StopController(cfg) as stop:
        return _train(cfg, schedule, report, stop)


def _with_schedule(cfg: TrainConfig, schedule: Schedule) -> TrainConfig:
    """``cfg`` with the v of the schedule it runs (``schedule auto`` chose it); a schedule of another pipeline or
    micro-batch count is a ValueError."""
    if (schedule.num_ranks, schedule.num_microbatches) != (cfg.pp, cfg.microbatches):
        raise ValueError(f"the schedule given ({schedule.name or 'unnamed'}) is for {schedule.num_ranks} pipeline ranks "
                         f"and {schedule.num_microbatches} micro-batches; the run has pp {cfg.pp}, microbatches "
                         f"{cfg.microbatches}")
    return cfg if schedule.chunks == cfg.chunks else replace(cfg, chunks=schedule.chunks)


def _train(cfg: TrainConfig, schedule: Schedule, report: Reporter | None, stop: StopController) -> TrainResult:
    note = (lambda text: report({"event": "note", "text": text})) if report is not None else None
    checkpoints = open_directory(cfg, group=dist.group.WORLD, note=note)  # rank 0 locks it for this run
    try:
        # may write tokenizer.json: after the lock, and after the resume check (a new value is checked once)
        cfg = prepare_on_rank0(cfg, check=resume_check(checkpoints)).check()
        run = _Run(cfg, schedule, report, checkpoints, stop)
    except BaseException:
        if checkpoints is not None:
            checkpoints.close()
        raise
    start = done = run.result.start_step
    stop.begin()
    if run.emit:
        run.emit({"event": "start", "start_step": start, "steps": cfg.steps, "params": run.result.num_parameters,
                  "unigram": run.result.unigram_baseline, "unigram_bpb": run.result.bits_per_byte(run.result.unigram_baseline),
                  "losses": list(run.result.losses)})
    try:
        for step in range(start, cfg.steps):
            verdict = run.step(step)
            if step == start:  # the first step checked every shape across ranks; later ones repeat it
                for module in run.modules.values():
                    set_shape_checks(module, False)
                run.loss_fn.check_shapes = False
            done = step + 1
            if verdict.stop:
                run.result.stop = run.stop_after(verdict, done)
                break
            stopping = done == cfg.steps or (cfg.exit_after and done - start >= cfg.exit_after)
            if done > cfg.steps - MEASURED_STEPS or stopping:
                run.telemetry.measure()
            if stopping:
                break
            if cfg.eval_every and done % cfg.eval_every == 0:
                run.validate(done)
            if cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
                run.save(done, wait=False)
        if run.result.stop is None:
            run.validate(done)
            if done > start:
                run.save(done)
            else:
                run.finish_save()
    finally:
        if checkpoints is not None:  # first: a background write still in flight (an error) ends before the groups
            checkpoints.close()
        run.close()
    run.result.skipped_steps = stop.skipped
    run.result.config = cfg
    if run.telemetry.gather_waits:
        run.result.exposed_gather = statistics.median(run.telemetry.gather_waits[-MEASURED_STEPS:])
    run.result.peak_held = run.runner.record.peak_held
    if run.offload is not None:
        run.result.offload_peak_bytes, run.result.offload_seconds = run.offload.reading.peak_bytes, run.offload.reading.seconds
    _measured(run.result, run.schedule, run.telemetry.timelines)
    if run.emit:
        run.emit({"event": "done"})
    return run.result


def _measured(result: TrainResult, schedule: Any, timelines: list[Any]) -> None:
    """The schedule, the last steps' timelines, their measured bubble and exposed data-parallel time."""
    result.schedule, result.timelines = schedule, timelines
    if timelines:
        result.bubble_measured = statistics.median(tl.bubble for tl in timelines)
        if any(any(tl.comm) for tl in timelines):  # d > 1
            result.exposed_reduction = statistics.median(max(tl.exposed_comm(REDUCTIONS)) for tl in timelines)
