"""Stopping under `torchrun --nproc-per-node 2` on gloo: a signal to one worker or to the agent, and restarts.

Slow (each torchrun starts three Python processes with torch): marked ``torchrun``, so that
`python -m pytest -m torchrun` runs them alone; the default run includes them.
"""

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from _wait import wait_gone, wait_until

from modelpar.checkpoint import latest_checkpoint
from modelpar.training.stopping import EXIT_PREEMPTED

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(600),  # a torchrun and its restart: minutes when loaded
              pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not installed")]

FLAGS = ["--backend", "gloo", "--tp", "1", "--pp", "2", "--hidden", "32", "--layers", "2", "--heads", "2",
         "--seq-len", "16", "--batch-size", "4", "--microbatches", "2", "--precision", "fp64", "--warmup", "1",
         "--eval-every", "0", "--eval-batches", "1", "--checkpoint-every", "2", "--no-progress"]


_started: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_run_left():
    """A test that failed half-way leaves no torchrun behind (its workers die with it)."""
    yield
    while _started:
        proc = _started.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def torchrun(tmp_path: Path, name: str, *options: str, steps: int = 12) -> subprocess.Popen:
    """`torchrun --nproc-per-node 2 [options] -m modelpar train ... --resume`, in a session of its own."""
    cmd = ["torchrun", "--nproc-per-node", "2", *options, "-m", "modelpar", "train", *FLAGS, "--steps", str(steps),
           "--checkpoint-dir", str(tmp_path / name), "--resume", "--out", str(tmp_path / f"{name}-out")]
    _started.append(subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)))
    return _started[-1]


def workers_when_saved(proc: subprocess.Popen, ckpt: Path) -> list[int]:
    """The agent's two workers, once the first checkpoint is complete."""
    wait_until(lambda: latest_checkpoint(ckpt), "the first checkpoint", alive=lambda: proc.poll() is None)
    pids = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()]
    assert len(pids) == 2
    return pids


def finish(proc: subprocess.Popen, workers: list[int]) -> tuple[int, str]:
    """torchrun's exit code and stderr, once it and ``workers`` (in sessions of their own) are gone."""
    _, err = proc.communicate(timeout=300)
    wait_gone(workers, "torchrun's workers")
    return proc.returncode, err


def losses(tmp_path: Path, name: str) -> list[float]:
    return json.loads((tmp_path / f"{name}-out" / "summary.json").read_text())["losses"]


def stop_line(err: str) -> str:
    """The one line saying where the run stopped (global rank 0 only; notes about the directory aside)."""
    lines = [line for line in err.splitlines() if re.match(r"modelpar train: (preempted|interrupted)", line)]
    assert len(lines) == 1, err
    return lines[0]


def preempted_line(err: str, ckpt: Path) -> int:
    lines = [stop_line(err)]
    pattern = (rf"modelpar train: preempted \(SIGTERM\) at step (\d+) of 12; checkpoint written: "
               rf"{re.escape(str(ckpt))}/step_\d+ \(resume continues from there\)")
    return int(re.fullmatch(pattern, lines[0])[1])


def test_sigterm_to_one_worker_saves_on_all_and_a_restart_resumes_bitwise(tmp_path):
    proc = torchrun(tmp_path, "a", "--max-restarts", "1")
    workers = workers_when_saved(proc, tmp_path / "a")
    os.kill(workers[1], signal.SIGTERM)  # one worker: all agree, save, exit 75; torchrun restarts them
    code, err = finish(proc, workers)
    assert code == 0 and f"failed (exitcode: {EXIT_PREEMPTED})" in err  # then restarted
    step = preempted_line(err, tmp_path / "a")
    assert json.loads((tmp_path / "a-out" / "summary.json").read_text())["start_step"] == step
    plain = torchrun(tmp_path, "b")
    assert finish(plain, [])[0] == 0  # uninterrupted
    assert losses(tmp_path, "a") == losses(tmp_path, "b")  # bitwise


def test_sigterm_to_the_agent_saves_on_every_worker(tmp_path):
    proc = torchrun(tmp_path, "c")
    workers = workers_when_saved(proc, tmp_path / "c")
    proc.send_signal(signal.SIGTERM)  # what Slurm and Kubernetes send: the agent passes it on to the workers
    code, err = finish(proc, workers)
    step = preempted_line(err, tmp_path / "c")
    assert code != 0 and latest_checkpoint(tmp_path / "c").name == f"step_{step:08d}"
    assert not list((tmp_path / "c").glob(".*"))


def test_ctrl_c_to_torchrun_stops_every_worker_without_a_save(tmp_path):
    proc = torchrun(tmp_path, "d")
    workers = workers_when_saved(proc, tmp_path / "d")
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the agent, which passes it on
    code, err = finish(proc, workers)
    step = int(re.fullmatch(r"modelpar train: interrupted \(SIGINT\) at step (\d+) of 12; last complete checkpoint: "
                            r".*/step_\d+ \(resume continues from there\)", stop_line(err))[1])
    assert code != 0 and latest_checkpoint(tmp_path / "d").name <= f"step_{step:08d}"
    assert not list((tmp_path / "d").glob(".*"))


def test_kill_9_of_the_agent_ends_every_worker_and_nothing_is_written_after(tmp_path):
    proc = torchrun(tmp_path, "e", steps=2000)  # minutes of training left
    workers = workers_when_saved(proc, tmp_path / "e")
    proc.kill()  # the workers have no agent left: they die with it (exit_with_parent)
    proc.wait(timeout=60)  # the agent is gone: its exit sent the workers SIGKILL, so none can start another write
    saved = sorted(p.name for p in (tmp_path / "e").iterdir())
    finish(proc, workers)  # the agent and every worker are gone: nothing can write after this
    assert sorted(p.name for p in (tmp_path / "e").iterdir()) == saved
