"""The local launcher (`python -m modelpar train`) under real signals: what the user sees, and what is left.

Each test starts the command in a session of its own, provokes the failure for real (kill -9 of a
rank, Ctrl-C while the forkserver imports torch or while the ranks build their model),
and checks the exit code, the one line, and that no process of the run outlives the launcher.
Every wait has a deadline and checks that the command is still running. SIGTERM to the launcher alone (nothing
of the run outlives it) is checked on the run of test_stopping's SIGTERM test, which also resumes from it.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from modelpar.training.faults import SLOW_INIT
from modelpar.training.stopping import EXIT_INTERRUPTED, StopController
from tests._ranks import alive, descendants
from tests._signals import CTRL_C_DEFAULT

FLAGS = ["--tp", "1", "--pp", "1", "--hidden", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--microbatches", "2",
         "--precision", "fp64", "--warmup", "1", "--eval-every", "0", "--eval-batches", "1", "--no-progress"]
DEADLINE = 120.0  # s for anything to happen on a loaded 2-core machine; a hang fails the test at it
POLL = 0.05  # s between looks at the process table: a look reads every process's /proc entry (ms of CPU)


def start(tmp_path: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "modelpar", "train", *FLAGS, "--out", str(tmp_path / "out"), *flags]
    return subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})},
                            **CTRL_C_DEFAULT)


def wait_for(proc: subprocess.Popen, what: str, ready, poll: float = POLL) -> object:
    """Poll ``ready()`` until it returns something truthy; fail if the command exits or the deadline passes."""
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        value = ready()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"the command exited ({proc.returncode}) before {what}: {proc.stderr.read()}")
        time.sleep(poll)
    proc.kill()
    pytest.fail(f"no {what} within {DEADLINE:g} s")


def ranks_of(proc: subprocess.Popen, n: int) -> dict[int, int] | None:
    """rank -> pid once all ``n`` ranks run (each names itself modelpar-rankR)."""
    named = {int(name[13:]): pid for pid, name in descendants(proc.pid).items() if re.fullmatch(r"modelpar-rank\d+", name)}
    return named if len(named) == n else None


def finish(proc: subprocess.Popen, watch=()) -> tuple[int, list[str], list[int]]:
    """Exit code, stderr lines, and which of ``watch`` were alive the moment the launcher's exit was seen.

    The exit is waited for first: reading stderr to its end would also wait for every process
    that inherited it, and hide one that outlives the launcher.
    """
    try:
        proc.wait(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its ranks follow through their lifeline
        proc.wait()
        pytest.fail(f"the command did not exit within {DEADLINE:g} s")
    left = alive(watch)
    return proc.returncode, [line for line in proc.stderr.read().splitlines() if line.strip()], left


def test_a_killed_rank_is_named_first_and_alone(tmp_path):
    proc = start(tmp_path, "--dp", "4", "--batch-size", "8", "--steps", "100000", "--checkpoint-dir",
                 str(tmp_path / "ck"), "--checkpoint-every", "1")
    ranks = wait_for(proc, "four ranks", lambda: ranks_of(proc, 4))
    wait_for(proc, "a first checkpoint", lambda: list((tmp_path / "ck").glob("step_*")))  # training, not starting
    os.kill(ranks[2], signal.SIGKILL)  # as the kernel's OOM killer would
    code, err, left = finish(proc, ranks.values())
    assert code == 1
    assert err[-1] == (f"modelpar train: error: rank 2 (pid {ranks[2]}) was killed by signal 9 (SIGKILL) (not sent "
                       "by modelpar: out of memory? The kernel's OOM killer sends SIGKILL; `dmesg` names its victims)")
    assert len(err) == 2 and err[0].startswith("modelpar train: 4 local processes")  # the banner, then the line
    assert left == []


def test_ctrl_c_while_the_forkserver_starts_prints_no_traceback(tmp_path):
    proc = start(tmp_path, "--dp", "2", "--batch-size", "4", "--steps", "100000")
    # the forkserver has loaded torch's library: it is importing torch (a second or more), when a Ctrl-C used to hit
    wait_for(proc, "the forkserver importing torch", lambda: any(
        "forkserver" in _cmdline(p) and "libtorch" in _maps(p) for p in descendants(proc.pid)), poll=0.02)  # a short window
    os.killpg(proc.pid, signal.SIGINT)
    code, err, _ = finish(proc)
    assert code == EXIT_INTERRUPTED
    assert not any("Traceback" in line or "KeyboardInterrupt" in line for line in err), err
    assert re.fullmatch(r"modelpar train: stopped at once before training started; no complete checkpoint", err[-1])


def test_ctrl_c_during_a_long_initialisation_stops_at_once(tmp_path):
    proc = start(tmp_path, "--dp", "2", "--batch-size", "4", "--steps", "100000", env={SLOW_INIT: "600"})
    ranks = wait_for(proc, "two ranks", lambda: ranks_of(proc, 2))
    os.killpg(proc.pid, signal.SIGINT)
    # each rank spends 600 s building its model: an exit within DEADLINE (120 s) proves the launcher did not
    # wait for the initialisation, let alone for a step after it
    code, err, left = finish(proc, ranks.values())
    assert code == EXIT_INTERRUPTED and err[-1] == (
        "modelpar train: stopped at once before training started; no complete checkpoint")
    assert not any("Traceback" in line for line in err), "\n".join(err)
    assert left == []


def test_ctrl_c_before_training_starts_raises_at_once_in_a_rank(python_ctrl_c):
    """The torchrun path (no launcher to end the ranks): a rank's own handler, before and after ``begin``."""
    from modelpar.training import TrainConfig

    with StopController(TrainConfig()) as stop:
        with pytest.raises(KeyboardInterrupt, match="before training started: nothing to save"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises at once; the sleep is never finished
        stop.begin()
        os.kill(os.getpid(), signal.SIGINT)  # recorded: the step boundary decides
        assert stop._request.name == "INTERRUPT"


def _maps(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""
