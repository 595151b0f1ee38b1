"""Stopping a run: Ctrl-C, preemption, a rank killed mid-step, NaN — real processes and real signals.

After each: no process of the run is left, no checkpoint newer than the stop is written, and where
one was written, resuming gives losses bitwise equal to an uninterrupted run. Two cases drive a
real `python -m modelpar train` (a signal to the launcher); the others signal the ranks of one
module-wide LocalCluster. Killing the launcher with `kill -9` is in test_distributed.py; torchrun
cases are in test_stopping_torchrun.py.
"""

import contextlib
import dataclasses
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _signals import CTRL_C_DEFAULT
from _wait import pid_alive, wait_until

from modelpar.checkpoint import latest_checkpoint
from modelpar.cli import build_parser, main
from modelpar.commands.train import build_config
from modelpar.distributed import LocalCluster, RankError
from modelpar.model import ModelConfig
from modelpar.training import TrainConfig, train
from modelpar.training.faults import INJECT_NONFINITE
from modelpar.training.stopping import EXIT_INTERRUPTED, EXIT_NONFINITE, EXIT_PREEMPTED
from tests._ranks import alive, descendants

# The tiny run of every case, as flags (for the command line) and as the config they make.
FLAGS = ["--tp", "1", "--pp", "2", "--hidden", "32", "--layers", "2", "--heads", "2", "--seq-len", "16",
         "--batch-size", "4", "--microbatches", "2", "--precision", "fp64", "--warmup", "1", "--eval-every", "0",
         "--eval-batches", "1", "--steps", "12"]
BASE = build_config(build_parser().parse_args(["train", *FLAGS]))
assert BASE.model == ModelConfig(hidden=32, layers=2, heads=2, seq_len=16) and BASE.steps == 12


def _train(cfg: TrainConfig, env: dict | None = None):
    """Rank side: train with ``env`` set for the run; the numbers a test compares."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.dims.world_size))  # as `modelpar train` ranks
    os.environ.update(env or {})
    try:
        r = train(cfg)
    finally:
        for key in env or {}:
            del os.environ[key]
    return r.losses, r.stop, r.skipped_steps, r.start_step


_UNINTERRUPTED: dict[TrainConfig, list[float]] = {}  # the module's uninterrupted runs: a longer one serves a shorter


def uninterrupted(c2, cfg: TrainConfig, steps: int) -> list[float]:
    """The losses of the first ``steps`` steps of ``cfg`` run without a stop (without checkpoints, and with no
    non-finite gradient to skip); one run serves every test of the same config (at least 16 steps of it)."""
    plain = dataclasses.replace(cfg, checkpoint_dir=None, checkpoint_every=0, resume=False, exit_after=0,
                                skip_nonfinite=0)
    if len(_UNINTERRUPTED.get(plain, [])) < steps:
        run = dataclasses.replace(plain, exit_after=min(plain.steps, max(steps, 16)))
        _UNINTERRUPTED[plain] = c2.run(_train, run)[0][0]
    return _UNINTERRUPTED[plain][:steps]


def steps_saved(ckpt: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in ckpt.glob("step_*"))


def check_resume_is_bitwise(c2, cfg: TrainConfig, start: int) -> None:
    """Resume two steps past checkpoint ``start``: the losses, the checkpoint's history included, are
    bitwise those of an uninterrupted run."""
    losses, stop, _, resumed_at = c2.run(_train, dataclasses.replace(cfg, resume=True, exit_after=2))[0]
    assert resumed_at == start and stop is None
    assert losses == uninterrupted(c2, cfg, start + 2)


def signal_when_saved(c2: LocalCluster, rank: int, sig: int, ckpt: Path) -> threading.Thread:
    """Send ``sig`` to ``rank`` once the first checkpoint is complete (the ranks are training).

    If the rank dies first or no checkpoint comes, nothing is sent and the test fails on the run's result.
    """
    def alive() -> bool:  # the ranks may still be starting
        return len(c2.pids) <= rank or pid_alive(c2.pids[rank])

    def wait_and_signal():
        wait_until(lambda: latest_checkpoint(ckpt), "the first checkpoint", alive=alive)
        os.kill(c2.pids[rank], sig)

    thread = threading.Thread(target=wait_and_signal, daemon=True)
    thread.start()
    return thread


# --- in the ranks: the world agrees on one rank's signal, and on one rank's NaN ------------------------
def test_sigterm_to_one_rank_saves_at_the_same_step_on_every_rank(c2, tmp_path):
    cfg = dataclasses.replace(BASE, checkpoint_dir=str(tmp_path), checkpoint_every=2, steps=400)
    signal_when_saved(c2, 1, signal.SIGTERM, tmp_path)  # under torchrun: `kill` of one worker
    results = c2.run(_train, cfg)
    stops = {r[1] for r in results}
    assert len(stops) == 1  # the same Stop on both ranks
    stop = stops.pop()
    assert stop.reason == "preempt" and stop.exit_code == EXIT_PREEMPTED and stop.step < 400
    assert stop.checkpoint == str(tmp_path / f"step_{stop.step:08d}") and steps_saved(tmp_path)[-1] == stop.step
    assert stop.message == f"preempted (SIGTERM) at step {stop.step} of 400; checkpoint written: {stop.checkpoint} " \
                           "(resume continues from there)"
    assert not list(tmp_path.glob(".*"))  # no temporary directory
    check_resume_is_bitwise(c2, cfg, stop.step)


def test_preemption_past_the_grace_period_writes_nothing(c2, tmp_path):
    cfg = dataclasses.replace(BASE, checkpoint_dir=str(tmp_path), checkpoint_every=2, steps=400, preempt_grace=1e-6)
    signal_when_saved(c2, 0, signal.SIGTERM, tmp_path)
    stop = c2.run(_train, cfg)[0][1]
    assert stop.reason == "preempt" and stop.exit_code == EXIT_PREEMPTED
    assert re.fullmatch(rf"preempted \(SIGTERM\) at step {stop.step} of 400, but the step ended [\d.]+ s after the "
                        r"signal and the last save took [\d.]+ s, past preempt_grace = 1e-06 s: no checkpoint written; "
                        rf"last complete checkpoint: {re.escape(stop.checkpoint)} \(resume continues from there\)",
                        stop.message), stop.message
    assert steps_saved(tmp_path)[-1] < stop.step  # nothing at the stop


def test_nan_at_step_k_stops_every_rank_and_nothing_is_saved_from_it(c2, tmp_path):
    cfg = dataclasses.replace(BASE, checkpoint_dir=str(tmp_path), checkpoint_every=1, steps=6)
    results = c2.run(_train, cfg, {INJECT_NONFINITE: "4:1"})  # rank 1 sees a NaN gradient in step 4
    stops = {r[1] for r in results}
    assert len(stops) == 1
    stop = stops.pop()
    assert (stop.reason, stop.step, stop.exit_code) == ("nonfinite", 4, EXIT_NONFINITE)
    assert stop.message.startswith("non-finite gradient norm (nan), first seen on rank 1 at step 4 of 6: stopped "
                                   "before the update, nothing saved from it; last complete checkpoint: ")
    assert steps_saved(tmp_path) == [2, 3]  # keep=2, and no step 4
    check_resume_is_bitwise(c2, cfg, 3)


def test_skip_nonfinite_skips_the_update_and_counts_it(c2):
    cfg = dataclasses.replace(BASE, steps=6, skip_nonfinite=1)
    losses, stop, skipped, _ = c2.run(_train, cfg, {INJECT_NONFINITE: "3:0"})[0]
    want = uninterrupted(c2, cfg, 6)
    assert stop is None and skipped == 1 and len(losses) == 6
    assert losses[:3] == want[:3] and losses[3] != want[3]  # step 3's loss came before its (skipped) update
    assert torch.isfinite(torch.tensor(losses)).all()


def test_a_rank_killed_mid_step_ends_the_run_and_the_last_checkpoint_resumes(c2, tmp_path):
    cfg = dataclasses.replace(BASE, checkpoint_dir=str(tmp_path), checkpoint_every=2, steps=400)
    pids = c2.pids  # started by the earlier cases
    signal_when_saved(c2, 1, signal.SIGKILL, tmp_path)
    with pytest.raises(RankError, match=r"^rank 1 \(pid \d+\) was killed by signal 9 \(SIGKILL\) \(not sent by modelpar"):
        c2.run(_train, cfg)
    assert not any(map(pid_alive, pids))  # every rank is gone, so nothing can be written after the kill:
    saved = steps_saved(tmp_path)  # what is on disk now is final
    assert latest_checkpoint(tmp_path) == tmp_path / f"step_{saved[-1]:08d}"
    check_resume_is_bitwise(c2, cfg, saved[-1])


def _group_timeouts(cfg):
    from modelpar._compat import group_timeout
    from modelpar.schedules import get_schedule
    from modelpar.training.setup import setup_rank

    rs = setup_rank(cfg, get_schedule(cfg.schedule, ranks=cfg.pp, microbatches=cfg.microbatches), cfg.timeout)
    groups = {"pp": rs.pp_group, "embed": rs.embed_group, "world": dist.group.WORLD}
    return {name: group_timeout(g) for name, g in groups.items()}  # read from each group's own backend


def test_every_group_of_the_run_has_the_run_timeout(c2):
    cfg = dataclasses.replace(BASE, timeout=17.0, model=dataclasses.replace(BASE.model, tie_embeddings=True))
    for got in c2.run(_group_timeouts, cfg):
        assert got == {"pp": 17.0, "embed": 17.0, "world": c2.timeout}  # the cluster's; not torch's 1800 s default


# --- `python -m modelpar train` and a signal to the launcher -------------------------------------------
@pytest.fixture
def start_cli(tmp_path: Path):
    """Starts the command in a session of its own (so the test can signal its process group), Ctrl-C
    enabled; at the end of the test, a session still running (the test failed) is killed."""
    started: list[subprocess.Popen] = []

    def start(*flags: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "modelpar", "train", *FLAGS, "--steps", "400", "--checkpoint-dir",
               str(tmp_path / "ckpt"), "--checkpoint-every", "2", "--no-progress", "--out", str(tmp_path / "out"), *flags]
        started.append(subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, **CTRL_C_DEFAULT))
        return started[-1]

    yield start
    for proc in started:
        if _session(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def finish(proc: subprocess.Popen) -> tuple[int, list[str]]:
    """Exit code and stderr lines; then check that no process of its session is left."""
    _, err = proc.communicate(timeout=120)
    wait_until(lambda: not _session(proc.pid), f"every process of the session of {proc.pid} to exit", timeout=10, poll=0.1)
    return proc.returncode, err.splitlines()


def _session(sid: int) -> list[str]:
    return subprocess.run(["pgrep", "-s", str(sid)], capture_output=True, text=True).stdout.split()


def test_sigterm_to_the_launcher_saves_at_the_next_step_and_exits_75(c2, start_cli, tmp_path):
    """Also: nothing of the run outlives the launcher (ranks, forkserver, resource tracker), checked the moment its
    exit is seen (it waited for them all); the run that test_launcher used to start for that alone is this one."""
    proc = start_cli()
    ckpt = tmp_path / "ckpt"
    wait_until(lambda: latest_checkpoint(ckpt), "the first checkpoint", alive=lambda: proc.poll() is None)
    everything = descendants(proc.pid)  # ranks, forkserver, resource tracker
    assert sum(name.startswith("modelpar-rank") for name in everything.values()) == 2 and len(everything) >= 4
    proc.send_signal(signal.SIGTERM)  # `kill PID`: the launcher only; it relays to its ranks
    proc.wait(timeout=120)  # the exit first: reading stderr to its end would also wait for what inherited it
    assert alive(everything) == []
    code, err = finish(proc)
    assert code == EXIT_PREEMPTED
    step = int(re.fullmatch(rf"modelpar train: preempted \(SIGTERM\) at step (\d+) of 400; checkpoint written: "
                            rf"{re.escape(str(ckpt))}/step_\d+ \(resume continues from there\)", err[-1])[1])
    assert steps_saved(ckpt)[-1] == step and len(err) == 2
    check_resume_is_bitwise(c2, dataclasses.replace(BASE, steps=400, checkpoint_dir=str(ckpt)), step)


def _no_traceback(err: list[str]) -> None:
    assert not any("Traceback" in line or "Exception ignored" in line for line in err), "\n".join(err)


def test_two_ctrl_c_0_3_s_apart_are_one_line_and_leave_no_process(start_cli, tmp_path):
    """Issue 35: the second Ctrl-C, landing while the ranks stop or the launcher exits, printed a traceback
    (atexit's forkserver stop) and left the forkserver and resource tracker behind."""
    proc = start_cli()
    wait_until(lambda: latest_checkpoint(tmp_path / "ckpt"), "the first checkpoint", alive=lambda: proc.poll() is None)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.3)  # the user's two presses; wherever the second lands, the checks below hold
    os.killpg(proc.pid, signal.SIGINT)
    code, err = finish(proc)  # every process of the session gone within 10 s
    _no_traceback(err)
    assert code == EXIT_INTERRUPTED and len(err) == 2 and err[1].startswith("modelpar train: ")
    assert "interrupted (SIGINT) at step" in err[1] or "stopped at once during step" in err[1]


def test_ctrl_c_stops_every_rank_with_one_line_and_a_second_the_moment_it_is_out_changes_nothing(start_cli, tmp_path):
    """Ctrl-C (the whole foreground process group): every rank stops, one line says where, no temporary directory.

    One run for two checks (a launcher start is seconds of the suite's CPU): the second Ctrl-C lands just after the
    launcher said where the run stopped, while it releases its lock and exits. It printed a second line,
    "interrupted (SIGINT)" (the default handler's, back once the run was reported; three runs of three). The
    command line's process now records such signals until it exits, so the run ends as after one Ctrl-C."""
    proc = start_cli()
    ckpt = tmp_path / "ckpt"
    wait_until(lambda: latest_checkpoint(ckpt), "the first checkpoint", alive=lambda: proc.poll() is None)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground process group
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=lambda: [*map(lines.put, proc.stderr), lines.put(None)], daemon=True).start()
    err, deadline = [], time.monotonic() + 120
    while (line := lines.get(timeout=max(0.1, deadline - time.monotonic()))) is not None:
        err.append(line.rstrip("\n"))
        if "interrupted (SIGINT) at step" in line:
            with contextlib.suppress(ProcessLookupError):  # gone already: nothing left to test, the lines still are
                os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == EXIT_INTERRUPTED
    wait_until(lambda: not _session(proc.pid), f"every process of the session of {proc.pid} to exit", timeout=10, poll=0.1)
    _no_traceback(err)
    assert len(err) == 2, err  # the banner, then the one line
    step = int(re.fullmatch(r"modelpar train: interrupted \(SIGINT\) at step (\d+) of 400; last complete checkpoint: "
                            rf"{re.escape(str(ckpt))}/step_(\d+) \(resume continues from there\)", err[-1])[1])
    assert steps_saved(ckpt)[-1] <= step
    assert not list(ckpt.glob(".*"))


def test_a_second_sigterm_ends_every_rank_and_exits_75(start_cli, tmp_path):
    """Issue 35: a second SIGTERM killed the launcher (143) and left processes behind; now it ends the ranks at once
    (or, once they are done, changes nothing) and the run exits 75 with one line."""
    proc = start_cli()
    wait_until(lambda: latest_checkpoint(tmp_path / "ckpt"), "the first checkpoint", alive=lambda: proc.poll() is None)
    os.killpg(proc.pid, signal.SIGTERM)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGTERM)
    code, err = finish(proc)
    _no_traceback(err)
    assert code == EXIT_PREEMPTED and len(err) == 2 and err[1].startswith("modelpar train: preempted (SIGTERM)")
    assert not list((tmp_path / "ckpt").glob(".*")) or "then SIGTERM again" in err[1]


def test_a_frozen_rank_is_named_in_one_line_within_the_timeout(start_cli, tmp_path):
    """Issue 35: a rank stopped by SIGSTOP under --timeout printed gloo's 54-line trace; now one line names it."""
    proc = start_cli("--timeout", "10")
    wait_until(lambda: latest_checkpoint(tmp_path / "ckpt"), "the first checkpoint", alive=lambda: proc.poll() is None)
    rank1 = int(subprocess.run(["pgrep", "-s", str(proc.pid), "modelpar-rank1"], capture_output=True,
                               text=True).stdout.split()[0])
    os.kill(rank1, signal.SIGSTOP)
    code, err = finish(proc)
    _no_traceback(err)
    assert code == 1 and len(err) == 2
    assert err[1] == (f"modelpar train: error: rank 1 (pid {rank1}) stopped answering (it is stopped: SIGSTOP or a "
                      "debugger): rank 0 waited the collective timeout of 10 s (--timeout) for it; every rank was ended")


def test_signals_after_the_run_are_recorded_and_a_ctrl_c_is_one_line(python_ctrl_c):
    """Issue 35: Ctrl-C after the summary exited 130 without a word. Once the ranks are gone the launcher records
    Ctrl-C and the preemption signal (real signals to this process) and says what they change."""
    from modelpar.training.stopping import LateSignals

    said: list[str] = []
    with LateSignals(BASE) as late:
        os.kill(os.getpid(), signal.SIGTERM)
        wait_until(lambda: late.seen, "SIGTERM to be recorded", timeout=10)
    assert late.exit_code(0, said.append) == 0 and said == ["SIGTERM after the run had finished: nothing left to save"]
    with LateSignals(BASE) as late:
        os.kill(os.getpid(), signal.SIGINT)
        wait_until(lambda: late.seen, "SIGINT to be recorded", timeout=10)
    assert late.exit_code(EXIT_PREEMPTED, said.append) == EXIT_PREEMPTED and len(said) == 1  # a stop keeps its line
    assert late.exit_code(0, said.append) == EXIT_INTERRUPTED
    assert said[1] == "interrupted (SIGINT) after the run had finished: its summary, metrics and checkpoints are complete"


def test_stop_flags_reach_the_config_and_bad_ones_are_one_line(capsys):
    args = build_parser().parse_args(["train", "--preempt-signal", "usr1", "--preempt-grace", "100",
                                      "--skip-nonfinite", "3"])
    cfg = build_config(args)
    assert (cfg.preempt_signal, cfg.preempt_grace, cfg.skip_nonfinite) == ("SIGUSR1", 100.0, 3)
    for flags, message in ((["--preempt-signal", "KILL"], "preempt_signal must be one of {SIGTERM, SIGUSR1, SIGUSR2}, "
                                                          "got 'SIGKILL'"),
                           (["--preempt-grace", "-1"], "preempt_grace must be >= 0.0, got -1.0"),
                           (["--skip-nonfinite", "-1"], "skip_nonfinite must be >= 0, got -1")):
        assert main(["train", *flags]) == 2
        assert capsys.readouterr().err == f"modelpar train: error: {message}\n"


# --- the launcher's side, without processes ------------------------------------------------------------
class _Ranks:
    """Stands in for the LocalCluster: records what the relay sends to the ranks."""

    def __init__(self):
        self.sent = []

    def signal(self, signum):
        self.sent.append(signum)


def test_the_launcher_relays_signals_to_the_ranks_and_keeps_the_grace_period(tmp_path):
    from modelpar.training.start import _Relay

    relay = _Relay(_Ranks(), dataclasses.replace(BASE, checkpoint_dir=str(tmp_path), preempt_grace=60))
    relay._on_signal(signal.SIGTERM, None)
    assert relay.cluster.sent == [signal.SIGTERM] and not relay.overdue()
    assert relay.stop().message == "preempted (SIGTERM) before training started: nothing to save; no complete checkpoint"
    relay.seen({"event": "start", "start_step": 4})
    assert relay.cluster.sent == [signal.SIGTERM, signal.SIGTERM]  # again, for ranks that were being born
    relay.seen({"event": "step", "step": 5})
    relay.preempted_at -= 61  # a step longer than the grace period
    assert relay.overdue()
    stop = relay.stop()
    assert (stop.reason, stop.step, stop.exit_code) == ("preempt", 5, EXIT_PREEMPTED)
    assert stop.message == ("preempted (SIGTERM) during step 6, which did not end within preempt_grace = 60 s: "
                            "no checkpoint written; no complete checkpoint")
    relay.seen({"event": "stopping", "step": 6, "save": True})
    assert not relay.overdue()  # the ranks are writing the checkpoint: the scheduler decides now
    relay._on_signal(signal.SIGINT, None)
    assert relay.cluster.sent == [signal.SIGTERM, signal.SIGTERM, signal.SIGINT]
    with pytest.raises(KeyboardInterrupt, match=r"^stopped at once during step 6; no complete checkpoint$"):
        relay._on_signal(signal.SIGINT, None)  # a second Ctrl-C
    relay._on_signal(signal.SIGINT, None)  # a third: the ranks are being ended, nothing more to do
    again = _Relay(_Ranks(), dataclasses.replace(BASE, checkpoint_dir=str(tmp_path), preempt_grace=60))
    again.seen({"event": "start", "start_step": 0})
    again._on_signal(signal.SIGTERM, None)
    assert again.cluster.sent == [signal.SIGTERM] and not again.overdue()
    again._on_signal(signal.SIGTERM, None)  # a second preemption signal: the ranks are ended at once
    assert again.cluster.sent == [signal.SIGTERM] and again.overdue()
    assert again.stop().message == ("preempted (SIGTERM) during step 1, then SIGTERM again: every rank ended at once, "
                                    "no checkpoint written at it; no complete checkpoint")
