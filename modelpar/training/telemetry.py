"""What a run measures beside its arithmetic: each step's figures, the data-parallel traffic, the events.

``StepTelemetry`` keeps the training loop's step short (batch → runner → gradient sync → clip → agree →
optimizer): it measures the activation bytes autograd holds in the first step, and after each step takes
the step's data-parallel bytes and collective spans, ZeRO-3's gathers and the time the compute waited for
them, the peak of full buckets, the step's time, loss and gradient norm, and hands rank 0's step event to
the reporter.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from modelpar.pipeline.measure import measured_timeline, message_bytes
from modelpar.pipeline.runner import PipelineRunner
from modelpar.recompute.meter import ActivationMeter
from modelpar.training.expert_stats import ExpertStats
from modelpar.training.metrics import peak_memory_mb
from modelpar.training.parts import DataParallel

if TYPE_CHECKING:
    from modelpar.training.loop import TrainResult

__all__ = ["MEASURED_STEPS", "STEP_FIELDS", "StepTelemetry"]

MEASURED_STEPS = 5  # the last steps whose timelines give the measured bubble
# The result's fields each step event carries under their own names (the step's measurements).
STEP_FIELDS = ("optimizer_state_bytes", "gradient_bytes", "parameter_bytes", "dp_bytes_sent", "all_gather_bytes",
               "reduce_scatter_bytes")


class StepTelemetry:
    """One rank's measurements of its steps, kept in ``result``; rank 0's events through ``emit``."""

    def __init__(self, result: TrainResult, dp: DataParallel, runner: PipelineRunner, experts: ExpertStats,
                 device: torch.device, emit: Callable[[dict[str, Any]], None] | None, held_bytes: bool = True) -> None:
        self.result, self.dp, self.runner, self.experts, self.device, self.emit = result, dp, runner, experts, device, emit
        # what autograd holds for backward, measured around every action of the first step only: each step holds
        # alike, and the meter's hooks on every saved tensor would cost each step (``held_bytes`` False under
        # --compile, whose graphs save inside their own functions)
        self.held = held = ActivationMeter() if held_bytes else None
        if held is not None:  # the meter, not self: no cycle keeping the run (and its groups) alive
            self.held_hook = runner.register_action_hook(lambda action, final: held)
        self.timelines: list[Any] = []  # the last measured steps' Timelines of this rank's pipeline
        self.comm_spans: list[tuple[str, float, float]] = []  # the last step's data-parallel collectives
        self.gather_waits: list[float] = []  # ZeRO-3: seconds waited for gathers, every step
        self.began = self.computing = 0.0  # when the step's pipeline began; the seconds to the gradients' finish

    def begin(self) -> None:
        """Before a step's pipeline: the peak of full buckets and the experts' counts start anew."""
        self.dp.meter.reset_peak()
        self.experts.reset()  # what a measuring pass outside the steps counted
        self.began = time.perf_counter()

    def computed(self) -> None:
        """After the pipeline and the gradient sync's finish: the rest of the step is its end (``record``)."""
        self.computing = time.perf_counter() - self.began

    def record(self, step: int, lr: float, loss: float, norm: float, seconds: float, moe: dict[str, Any],
               tokens_per_step: int) -> None:
        """After a step: its figures into the result, and rank 0's step event."""
        r, dp = self.result, self.dp
        if self.held is not None:  # the first step measured: its hooks go
            r.peak_held_bytes, self.held = self.held.peak_bytes, None
            self.held_hook.remove()
        if dp.gather is not None:
            r.gathers_per_step, waited = dp.gather.take_step()
            self.gather_waits.append(waited)
        r.dp_bytes_sent, self.comm_spans = dp.comm.take_step()
        r.all_gather_bytes = dp.comm.last_step_bytes.get("all-gather", 0.0)
        r.reduce_scatter_bytes = dp.comm.last_step_bytes.get("reduce-scatter", 0.0)
        r.peak_buffer_bytes = max(r.peak_buffer_bytes, dp.meter.peak)
        r.step_times.append(seconds)
        r.step_end_times.append(seconds - self.computing)
        r.losses.append(loss)
        r.grad_norms.append(norm)
        if moe:
            r.expert_imbalance = max(r.expert_imbalance or 0.0, moe["expert_imbalance"])
        if r.message_bytes is None:
            r.message_bytes = message_bytes(self.runner)
        if self.emit:
            self.emit({"event": "step", "step": step + 1, "loss": loss, "grad_norm": norm, "lr": lr,
                       "tokens_per_s": tokens_per_step / seconds, "step_time": seconds,
                       "peak_memory_mb": peak_memory_mb(self.device), **r.fields(STEP_FIELDS),
                       "gathers": r.gathers_per_step, "peak_buffer_bytes": dp.meter.peak, **moe})

    def after_evaluation(self) -> None:
        """ZeRO-3: free what an evaluation gathered; its collectives are no step's."""
        if self.dp.gather is not None:
            self.dp.gather.release_all()
            self.dp.gather.take_step()
            self.dp.comm.take_step()

    def measure(self) -> None:
        """Keep this step's timeline, with the data-parallel collectives (a collective over the pipeline group)."""
        self.timelines = self.timelines[-(MEASURED_STEPS - 1):] + [measured_timeline(self.runner, self.comm_spans)]
