"""Start a training run: on local processes (the default) or in torchrun's processes.

Locally, ``run_local`` starts t·p·d ranks in a ``LocalCluster``, runs them from a background
thread and feeds rank 0's events, which come back through the cluster's result queue
(``modelpar.distributed.to_launcher``), to the display; a rank's error ends every rank and is re-raised
here with its rank. Signals to this process are relayed to the ranks (``_Relay``), which stop
together at a step boundary. Under torchrun each process calls ``run_in_process`` (NCCL on GPUs)
and torchrun's agent relays the signals.

The schedule is resolved once, where the run starts, and shipped to the ranks: ``run_local`` builds it in
the launcher and hands it to every rank; ``train`` (under torchrun, or called by hand on every rank)
builds it on global rank 0 and broadcasts its text form. With ``schedule auto`` that is the cost model's
synthesis; the ranks themselves never consult the cost model (``modelpar.training.loop``).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from modelpar.checkpoint import latest_checkpoint
from modelpar.distributed import LocalCluster, exit_with_parent, init_from_env, preload, to_launcher
from modelpar.schedules import Schedule
from modelpar.text import prepare_data
from modelpar.training.config import TrainConfig
from modelpar.training.loop import Reporter, TrainResult, train_rank
from modelpar.training.resume import check_resume
from modelpar.training.stopping import EXIT_PREEMPTED, LateSignals, Stop, handled

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["rank_threads", "run_in_process", "run_local", "train"]

preload(__name__)  # ranks run ``_rank_main``: born with the training stack (checkpointing, DTensor) imported

_DONE: dict[str, Any] = {}  # the run's thread has its outcome: no event follows


def rank_threads(world_size: int) -> int:
    """Threads each of ``world_size`` local ranks computes with: the cores split evenly (no oversubscription)."""
    return max(1, (os.cpu_count() or 1) // world_size)


def train(cfg: TrainConfig, report: Reporter | None = None, schedule: Schedule | None = None) -> TrainResult:
    """Train on this rank; every rank of the default process group calls it with the same ``cfg``.

    ``schedule``: the one to run, when the caller built it; else global rank 0 builds it (``run_schedule``: with
    ``schedule auto`` the cost model's synthesis) and every rank receives its text. A config rank 0 refuses is
    the same ValueError on every rank.
    """
    return train_rank(cfg, schedule if schedule is not None else _shipped_schedule(cfg), report)


def _shipped_schedule(cfg: TrainConfig) -> Schedule:
    """The run's schedule, built on global rank 0 and broadcast as (name, text) (a collective)."""
    import torch.distributed as dist

    from modelpar.training.prediction import run_schedule

    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            built = run_schedule(cfg.check(dist.get_world_size()))
            box[0] = ("schedule", built.name, built.to_text())
        except ValueError as err:
            box[0] = ("error", str(err), "")
    dist.broadcast_object_list(box, src=0)
    kind, name, text = box[0]
    if kind == "error":
        raise ValueError(name)
    return Schedule.from_text(text, name=name)


def _rank_main(cfg: TrainConfig, schedule: Schedule) -> TrainResult:
    import torch

    torch.set_num_threads(rank_threads(cfg.dims.world_size))
    return train_rank(cfg, schedule, report=to_launcher())  # only rank 0 reports


class _Relay:
    """In the launching process: pass Ctrl-C and the preemption signal on to the ranks.

    Training ranks stop together at the next step boundary. Before rank 0 reports "start" (ranks
    starting up, building the model, loading a checkpoint: nothing to save) a Ctrl-C ends every rank
    at once (``end_now``), and a preemption signal is passed on again at "start". A second Ctrl-C
    ends every rank at once (KeyboardInterrupt), and so do a preemption whose step outlasts
    ``preempt_grace`` and a second preemption signal (a ``Stop``, no checkpoint written then).
    """

    def __init__(self, cluster: LocalCluster, cfg: TrainConfig) -> None:
        self.cluster, self.cfg = cluster, cfg
        self.preempt_signal = signal.Signals[cfg.preempt_signal]
        self.started = self.stopping = False  # rank 0 said "start" / "stopping"
        self.start_step = self.step = 0  # where the run started, the last step rank 0 reported done
        self.interrupted = False
        self.preempted_at: float | None = None
        self.again = False  # a second preemption signal: end every rank at once
        self.finished = False  # the ranks' outcome is in: a signal while they exit changes nothing

    def handlers(self) -> contextlib.AbstractContextManager[None]:
        """Ctrl-C and the preemption signal to this relay, inside the block."""
        return handled((signal.SIGINT, self.preempt_signal), self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:  # only flags and signals: the loop ends ranks
        if self.finished:  # the run's outcome is decided and the ranks are leaving (the cluster's close ends them)
            return
        if signum == signal.SIGINT:
            if self.interrupted:
                self.finished = True  # the ranks are ended at once (LocalCluster's exit): later signals change nothing
                raise KeyboardInterrupt(self.interrupted_at_once())
            self.interrupted = True
        elif self.preempted_at is None:
            self.preempted_at = time.monotonic()
        else:
            self.again = True  # the loop ends the ranks (a handler only flags and signals)
            return
        self.cluster.signal(signum)

    def seen(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "start":  # the ranks' handlers are in place: pass on again what they may have missed
            self.started, self.start_step = True, event["start_step"]
            self.step = self.start_step
            if self.interrupted:
                self.cluster.signal(signal.SIGINT)
            if self.preempted_at is not None:
                self.cluster.signal(self.preempt_signal)
        elif kind == "step":
            self.step = event["step"]
        elif kind == "stopping":
            self.stopping = True

    def end_now(self) -> bool:
        """Ctrl-C before training started: nothing to save or finish, so the ranks end at once."""
        return self.interrupted and not self.started

    def overdue(self) -> bool:
        """Preempted again, or preempted and the ranks have not reached a step boundary within the grace period."""
        grace = self.cfg.preempt_grace
        return self.again or (self.preempted_at is not None and not self.stopping and grace > 0
                              and time.monotonic() > self.preempted_at + grace)

    def _last_checkpoint(self) -> str:
        latest = latest_checkpoint(self.cfg.checkpoint_dir, checksums=False) if self.cfg.checkpoint_dir else None
        return f"last complete checkpoint: {latest}" if latest else "no complete checkpoint"

    def _when(self) -> str:
        return f"during step {self.step + 1}" if self.started else "before training started"

    def interrupted_at_once(self) -> str:
        """The line of a Ctrl-C that ended the ranks without a step boundary."""
        return f"stopped at once {self._when()}; {self._last_checkpoint()}"

    def stop(self) -> Stop:
        """The Stop of a preemption that ended the ranks without a step boundary."""
        latest = latest_checkpoint(self.cfg.checkpoint_dir, checksums=False) if self.cfg.checkpoint_dir else None
        head = f"preempted ({self.preempt_signal.name}) {self._when()}"
        if not self.started:
            message = f"{head}: nothing to save; {self._last_checkpoint()}"
        elif self.again:
            message = (f"{head}, then {self.preempt_signal.name} again: every rank ended at once, no checkpoint "
                       f"written at it; {self._last_checkpoint()}")
        else:
            message = (f"{head}, which did not end within preempt_grace = {self.cfg.preempt_grace:g} s: "
                       f"no checkpoint written; {self._last_checkpoint()}")
        return Stop("preempt", self.step, None if latest is None else str(latest), message, EXIT_PREEMPTED)


def run_local(cfg: TrainConfig, display: Callable[[dict[str, Any]], None] | None = None,
              console: Console | None = None, progress: bool = False, late: LateSignals | None = None) -> TrainResult:
    """Train on t·cp·p·d new local processes (gloo); return rank 0's result.

    The data is prepared here, once, before any rank starts (``modelpar.text.prepare_data``; on
    ``console`` with ``progress`` bars, which then also gets a line naming the processes), and a
    checkpoint to resume from is checked against the run. Ctrl-C and the preemption signal stop
    every rank at the next step boundary, with ``TrainResult.stop`` saying where; a second Ctrl-C
    ends them at once (KeyboardInterrupt). ``late`` (the caller's, closed by it) records the signals
    that come once the relay's handlers are gone: a second SIGTERM just after the ranks stopped is recorded,
    not the default's kill.
    """
    # a checkpoint of another model, data or optimisation, or none valid: refused before starting ranks, and
    # before the tokenizer is written to the checkpoint directory (a refused run writes nothing there)
    cfg = prepare_data(cfg.check(), console, progress=progress, check=check_resume).check()
    from modelpar.training.prediction import run_schedule

    schedule = run_schedule(cfg)  # built once, here: the ranks receive it
    if console is not None:
        console.print(f"modelpar train: {cfg.dims.world_size} local processes ({cfg.layout()}), "
                      f"{cfg.model.num_parameters():,} parameters, {cfg.steps} steps",
                      highlight=False, soft_wrap=True)  # one line, whatever the terminal's width
    outcome: dict[str, Any] = {}
    overdue = False
    events: queue.Queue[dict[str, Any]] = queue.Queue()  # get(timeout) lets the signal handlers run
    cluster = LocalCluster(cfg.dims.world_size, timeout=cfg.timeout, run_timeout=None, on_message=events.put)
    relay = _Relay(cluster, cfg)
    try:
        if late is not None:
            late.start()  # under the relay's handlers: what they give back when the ranks are gone
        with relay.handlers(), cluster:  # the relay's handlers until the ranks are gone (close waits for them)

            def target() -> None:
                try:
                    outcome["result"] = cluster.run(_rank_main, cfg, schedule)[0]
                except BaseException as err:
                    outcome["error"] = err
                events.put(_DONE)

            def show(event: dict[str, Any]) -> None:
                relay.seen(event)
                if display is not None:
                    display(event)

            worker = threading.Thread(target=target, name="modelpar-train", daemon=True)
            worker.start()
            while not relay.finished:
                try:  # an event is shown as it arrives; the timeout only paces the relay's checks
                    event = events.get(timeout=0.2)
                except queue.Empty:
                    event = None
                if event is _DONE:
                    relay.finished = True
                elif event is not None:
                    show(event)
                if relay.end_now():  # every pass: also ends ranks the cluster was still starting
                    cluster.kill()
                elif not overdue and relay.overdue():
                    overdue = True
                    cluster.kill()
    finally:
        if display is not None and hasattr(display, "close"):
            display.close()
    if "result" in outcome:
        return outcome["result"]
    # the ranks ended without a step boundary: still starting when the signal came, or past the grace
    if relay.interrupted:
        raise KeyboardInterrupt(relay.interrupted_at_once())
    if relay.preempted_at is not None and (relay.again or not relay.stopping):
        return TrainResult(relay.start_step, stop=relay.stop())
    raise outcome["error"]


def run_in_process(cfg: TrainConfig, display: Callable[[dict[str, Any]], None] | None = None,
                   backend: str | None = None) -> TrainResult:
    """Train as one rank of torchrun's processes; return its result (the numbers are the same on every rank).

    ``display`` shows global rank 0's progress. ``backend``: "gloo" or "nccl"; None picks NCCL when
    CUDA is available (``init_from_env``). The process ends if torchrun's agent dies.
    """
    import torch.distributed as dist

    exit_with_parent()
    init_from_env(backend, timeout=cfg.timeout)
    try:
        result = train(cfg, report=display if dist.get_rank() == 0 else None)
        if result.stop is not None and threading.current_thread() is threading.main_thread():
            # torchrun's agent sends SIGTERM to the workers still exiting once one has exited
            # non-zero: it must not turn their documented exit code into a kill
            for sig in {signal.SIGTERM, signal.Signals[cfg.preempt_signal]}:
                signal.signal(sig, signal.SIG_IGN)
        return result
    finally:
        dist.destroy_process_group()
