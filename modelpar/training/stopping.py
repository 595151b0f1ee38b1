"""Stopping a run on every rank at the same step: Ctrl-C, preemption, non-finite values.

A signal handler only records what arrived. Every step the loop folds each rank's record into
the one reduction it makes anyway (the step's loss: an all-gather of a few numbers per rank), so
every rank reads the same table and takes the same decision at the same step boundary::

    SIGINT / SIGTERM ──▶ handler records (request, time)
    step k: pipeline, gradient sync, global norm ──▶ all_gather per rank:
        [loss · weight, request, s since the signal, s the last save took, loss finite?, grads finite?]
    every rank, same table ──▶ update and go on | skip the update | stop (with a checkpoint?)

- Ctrl-C (SIGINT): stop after the step, no checkpoint (exit 130). Before the first step
  (``begin`` not yet called: building the model, loading a checkpoint) there is nothing to save
  and no step to finish: KeyboardInterrupt at once, so a long initialisation stops within a moment.
- The preemption signal (``preempt_signal``, SIGTERM by default): stop after the step and write a
  checkpoint at it if the signal's age plus the last save's duration fits in ``preempt_grace``;
  otherwise say so and write nothing (exit 75 either way: run again with ``resume``).
- A non-finite loss or gradient norm: stop before the optimizer step (exit 65), or skip that
  update, at most ``skip_nonfinite`` times. Parameters never take a non-finite update, so nothing
  non-finite is ever saved.

No save starts once a stop is decided, and none is cut short by one, so a stop leaves no
temporary checkpoint directory behind.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from modelpar.training.config import TrainConfig

__all__ = ["EXIT_INTERRUPTED", "EXIT_NONFINITE", "EXIT_PREEMPTED", "LateSignals", "Stop", "StopController", "Verdict",
           "handled"]

EXIT_NONFINITE = 65  # EX_DATAERR: a non-finite loss or gradient norm
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: preempted; run again with --resume
EXIT_INTERRUPTED = 130  # 128 + SIGINT


class Request(IntEnum):
    """What a signal asks for; the highest over the ranks wins (a checkpoint is worth the wait)."""

    NONE = 0
    INTERRUPT = 1
    PREEMPT = 2


@dataclass(frozen=True)
class Stop:
    """Why and where a run stopped early (``TrainResult.stop``), the same on every rank."""

    reason: str  # "interrupt", "preempt" or "nonfinite"
    step: int  # the step (1-based) it stopped after; a checkpoint written on the way out is at it.
    #            A non-finite step's update is not applied.
    checkpoint: str | None  # the latest complete checkpoint afterwards (None: there is none)
    message: str  # one line for the user
    exit_code: int  # EXIT_INTERRUPTED, EXIT_PREEMPTED or EXIT_NONFINITE


@dataclass(frozen=True)
class Verdict:
    """What every rank does after a step: apply the update or not, stop or not, save or not."""

    loss: float  # the step's loss, mean over the replicas
    update: bool = True  # apply the optimizer step (False: a non-finite step)
    stop: str | None = None  # None, or why the run stops after this step: interrupt, preempt, nonfinite
    save: bool = False  # write a checkpoint at this step before stopping
    detail: str = ""  # for the message: the non-finite value and its rank, or why no checkpoint


@contextlib.contextmanager
def handled(signals: Iterable[int], handler: Callable[[int, Any], None]) -> Iterator[None]:
    """Route ``signals`` to ``handler`` inside the block, then restore the previous handlers.

    Only in the main thread (where Python delivers signals), and never over a signal the process
    ignores (a background job's SIGINT stays ignored).
    """
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in signals:
            old = signal.getsignal(sig)
            if old is not signal.SIG_IGN:
                previous[sig] = signal.SIG_DFL if old is None else old
                signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class LateSignals:
    """In the launcher once its ranks have ended: Ctrl-C and the preemption signal only recorded while the run
    writes its summary and exits (short work a signal would cut with a traceback, or a kill leaving the lock
    and helper processes behind). A context manager, or ``start`` … ``close`` where recording must begin later
    than the block (``run_local``: as its relay lets go); ``exit_code`` says what they change."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.signals = (signal.SIGINT, signal.Signals[cfg.preempt_signal])
        self.seen: list[int] = []
        self._handlers = contextlib.ExitStack()
        self._started = False

    def __enter__(self) -> LateSignals:
        self.start()
        return self

    def start(self) -> None:
        """Record the signals from now on (``run_local`` starts it just outside its relay's handlers, so that when
        the ranks are gone and the relay's handlers are restored, a signal is recorded, never the default's kill)."""
        if not self._started:
            self._started = True
            self._handlers.enter_context(handled(self.signals, lambda signum, frame: self.seen.append(signum)))

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """The handlers from before ``start`` again."""
        self._handlers.close()

    def exit_code(self, code: int, say: Callable[[str], None]) -> int:
        """The run's ``code``, or 130 for a Ctrl-C that came after it had finished (said in one line by ``say``).
        A run that stopped keeps its code and line; a preemption after the end has nothing left to save."""
        if code != 0 or not self.seen:
            return code
        if signal.SIGINT in self.seen:
            say("interrupted (SIGINT) after the run had finished: its summary, metrics and checkpoints are complete")
            return EXIT_INTERRUPTED
        say(f"{signal.Signals(self.seen[0]).name} after the run had finished: nothing left to save")
        return code


class StopController:
    """One rank's signal handlers (``handled``) and per-step agreement; a context manager around ``train``."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.preempt_signal = signal.Signals[cfg.preempt_signal]
        self.skipped = 0  # non-finite steps whose update was skipped
        self._request = Request.NONE
        self._preempted_at: float | None = None  # time.monotonic() of the first preemption signal
        self._save_seconds = 0.0  # how long this rank's last save took
        self._handlers = contextlib.ExitStack()
        self._training = False  # begin() called: a Ctrl-C waits for the step boundary

    def __enter__(self) -> StopController:
        self._handlers.enter_context(handled((signal.SIGINT, self.preempt_signal), self._on_signal))
        return self

    def __exit__(self, *exc: object) -> None:
        self._handlers.close()

    def begin(self) -> None:
        """Training starts: from now on a Ctrl-C stops every rank together at a step boundary."""
        self._training = True

    def _on_signal(self, signum: int, frame: Any) -> None:
        request = Request.PREEMPT if signum == self.preempt_signal else Request.INTERRUPT
        if request == Request.INTERRUPT and not self._training:
            raise KeyboardInterrupt("interrupted (SIGINT) before training started: nothing to save")
        self._request = max(self._request, request)
        if request == Request.PREEMPT and self._preempted_at is None:
            self._preempted_at = time.monotonic()

    def saved(self, seconds: float) -> None:
        """Record how long a save took: the estimate for a save inside the grace period."""
        self._save_seconds = seconds

    def agree(self, loss: float | None, weight: float, norm: float, params: list[torch.nn.Parameter],
              device: torch.device) -> Verdict:
        """Collective, every rank, every step: the step's mean loss and what every rank does next.

        ``loss``: this rank's loss (None where it has none), ``weight`` its share of the mean;
        ``norm``: the global gradient norm (the same on every rank); ``params``: this rank's, whose
        gradients are looked at only when ``norm`` is not finite, to name a rank that saw it.
        """
        since = time.monotonic() - self._preempted_at if self._preempted_at is not None else 0.0
        bad_grads = not math.isfinite(norm) and any(
            p.grad is not None and not bool(torch.isfinite(p.grad).all()) for p in params)
        row = torch.tensor([0.0 if loss is None else loss * weight, float(self._request), since,
                            self._save_seconds, float(loss is not None and not math.isfinite(loss)),
                            float(bad_grads)], dtype=torch.float64, device=device)
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, row)
        table = torch.stack(rows).cpu().tolist()
        mean = sum(r[0] for r in table)
        request = Request(int(max(r[1] for r in table)))
        verdict = Verdict(mean)
        if not (math.isfinite(mean) and math.isfinite(norm)):
            what = "loss" if not math.isfinite(mean) else "gradient norm"
            seen = [rank for rank, r in enumerate(table) if r[4] or r[5]]
            detail = f"non-finite {what} ({mean if what == 'loss' else norm})" + (
                f", first seen on rank {seen[0]}" if seen else "")
            self.skipped += 1
            if self.skipped > self.cfg.skip_nonfinite:
                return Verdict(mean, update=False, stop="nonfinite", detail=detail)
            verdict = Verdict(mean, update=False)
        return verdict if request == Request.NONE else self._stop(request, table, verdict)

    def _stop(self, request: Request, table: list[list[float]], verdict: Verdict) -> Verdict:
        """``verdict`` with the stop ``request`` asks for: a checkpoint if it is a preemption that fits in the grace."""
        if request == Request.INTERRUPT:
            return replace(verdict, stop="interrupt")
        since, save_seconds, grace = max(r[2] for r in table), max(r[3] for r in table), self.cfg.preempt_grace
        if not self.cfg.checkpoint_dir:
            return replace(verdict, stop="preempt", detail="nothing saved (no checkpoint_dir)")
        if grace and since + save_seconds > grace:
            return replace(verdict, stop="preempt", detail=(
                f"but the step ended {since:.1f} s after the signal and the last save took {save_seconds:.1f} s, "
                f"past preempt_grace = {grace:g} s: no checkpoint written"))
        return replace(verdict, stop="preempt", save=True)

    def outcome(self, verdict: Verdict, step: int, written: str | None, latest: str | None) -> Stop:
        """The ``Stop`` a run ends with after ``verdict`` at ``step``: ``written`` is the checkpoint
        saved on the way out (None: none), ``latest`` the latest complete one now."""
        where = f"at step {step} of {self.cfg.steps}"
        last = (f"last complete checkpoint: {latest} (resume continues from there)" if latest else
                "no complete checkpoint yet" if self.cfg.checkpoint_dir else "no checkpoint_dir, nothing saved")
        if verdict.stop == "nonfinite":
            hint = "" if self.cfg.skip_nonfinite else "; skip_nonfinite = N skips up to N such steps"
            message = f"{verdict.detail} {where}: stopped before the update, nothing saved from it; {last}{hint}"
            return Stop("nonfinite", step, latest, message, EXIT_NONFINITE)
        if verdict.stop == "interrupt":
            return Stop("interrupt", step, latest, f"interrupted (SIGINT) {where}; {last}", EXIT_INTERRUPTED)
        head = f"preempted ({self.preempt_signal.name}) {where}"
        if written:
            message = f"{head}; checkpoint written: {written} (resume continues from there)"
        elif self.cfg.checkpoint_dir:
            message = f"{head}, {verdict.detail}; {last}"
        else:
            message = f"{head}; {verdict.detail}"
        return Stop("preempt", step, latest, message, EXIT_PREEMPTED)
