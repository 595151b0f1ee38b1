"""Stopping under `torchrun --nproc-per-node 2` on gloo: a signal to one worker or to the agent, and restarts.

Slow (each torchrun starts three Python processes with torch): marked ``torchrun``, so that
`python -m pytest -m torchrun` runs them alone; the default run includes them. Three torchruns in
all: one is stopped twice (a worker's SIGTERM, which torchrun restarts, then the agent's), and its
losses across the restart are compared with an uninterrupted run of the local launcher, in this
process (the same training code; torchrun is what is under test, not the reference).
"""

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from _signals import CTRL_C_DEFAULT
from _wait import DEADLINE, wait_gone, wait_until

from modelpar.checkpoint import latest_checkpoint
from modelpar.cli import main
from modelpar.training.start import rank_threads
from modelpar.training.stopping import EXIT_PREEMPTED

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(600),  # a torchrun and its restart: minutes when loaded
              pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not installed")]

MODEL = ["--tp", "1", "--pp", "2", "--hidden", "32", "--layers", "2", "--heads", "2", "--seq-len", "16",
         "--batch-size", "4", "--microbatches", "2", "--precision", "fp64", "--warmup", "1", "--eval-every", "0",
         "--eval-batches", "1", "--no-progress"]
STEPS = 400  # far more than a test lets run: a signal sent after the first checkpoint always finds the run training
FLAGS = ["--backend", "gloo", *MODEL, "--checkpoint-every", "2"]


_started: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_run_left():
    """A test that failed half-way leaves no torchrun behind (its workers die with it)."""
    yield
    while _started:
        proc = _started.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def torchrun(tmp_path: Path, name: str, *options: str, steps: int = STEPS) -> subprocess.Popen:
    """`torchrun --nproc-per-node 2 [options] -m modelpar train ... --resume`, in a session of its own; its
    stderr goes to ``name``.err (read while it runs), its workers compute on as many threads as local ranks."""
    cmd = ["torchrun", "--nproc-per-node", "2", *options, "-m", "modelpar", "train", *FLAGS, "--steps", str(steps),
           "--checkpoint-dir", str(tmp_path / name), "--resume", "--out", str(tmp_path / f"{name}-out")]
    with open(tmp_path / f"{name}.err", "w") as err:
        _started.append(subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=err,
                                         env={**os.environ, "OMP_NUM_THREADS": str(rank_threads(2))},
                                         **CTRL_C_DEFAULT))
    return _started[-1]


def running(proc: subprocess.Popen):
    return lambda: proc.poll() is None


def workers_of(proc: subprocess.Popen) -> list[int]:
    """The agent's workers (its children) now: two."""
    pids = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()]
    assert len(pids) == 2, pids
    return pids


def workers_when_saved(proc: subprocess.Popen, ckpt: Path) -> list[int]:
    """The agent's two workers, once the first checkpoint is complete."""
    wait_until(lambda: latest_checkpoint(ckpt), "the first checkpoint", alive=running(proc))
    return workers_of(proc)


def finish(proc: subprocess.Popen, workers: list[int], tmp_path: Path, name: str) -> tuple[int, str]:
    """torchrun's exit code and stderr, once it and ``workers`` (in sessions of their own) are gone."""
    proc.wait(timeout=300)
    wait_gone(workers, "torchrun's workers")
    return proc.returncode, (tmp_path / f"{name}.err").read_text()


def stop_lines(err: str) -> list[str]:
    """The lines saying where the run stopped (global rank 0 only; notes about the directory aside)."""
    return [line for line in err.splitlines() if re.match(r"modelpar train: (preempted|interrupted)", line)]


def preempted_at(line: str, ckpt: Path) -> int:
    pattern = (rf"modelpar train: preempted \(SIGTERM\) at step (\d+) of {STEPS}; checkpoint written: "
               rf"{re.escape(str(ckpt))}/step_\d+ \(resume continues from there\)")
    match = re.fullmatch(pattern, line)
    assert match, line
    return int(match[1])


def uninterrupted(tmp_path: Path, steps: int) -> list[float]:
    """The losses of the first ``steps`` steps, run at once by the local launcher (--exit-after needs a checkpoint_dir)."""
    out = tmp_path / "uninterrupted"
    assert main(["train", *MODEL, "--steps", str(STEPS), "--exit-after", str(steps), "--out", str(out),
                 "--checkpoint-dir", str(tmp_path / "uninterrupted-ck")]) == 0
    return json.loads((out / "summary.json").read_text())["losses"]


def test_sigterm_to_a_worker_and_then_to_the_agent_saves_on_all_and_the_restart_resumes_bitwise(tmp_path):
    ckpt = tmp_path / "a"
    proc = torchrun(tmp_path, "a", "--max-restarts", "1")
    first = workers_when_saved(proc, ckpt)
    os.kill(first[1], signal.SIGTERM)  # one worker: all agree, save, exit 75; torchrun restarts them
    line = wait_until(lambda: stop_lines((tmp_path / "a.err").read_text()), "the first stop", alive=running(proc))[0]
    saved = preempted_at(line, ckpt)
    wait_gone(first, "the first workers", timeout=DEADLINE)
    wait_until(lambda: int(getattr(latest_checkpoint(ckpt), "name", "step_0")[5:]) > saved,
               "a checkpoint of the restarted workers", alive=running(proc))  # they resumed and are training
    second = workers_of(proc)
    assert not set(second) & set(first)
    proc.send_signal(signal.SIGTERM)  # what Slurm and Kubernetes send: the agent passes it on to the workers
    code, err = finish(proc, second, tmp_path, "a")
    assert code != 0 and f"failed (exitcode: {EXIT_PREEMPTED})" in err  # the first stop, then restarted
    lines = stop_lines(err)
    assert len(lines) == 2 and lines[0] == line, err
    assert f"modelpar train: resuming from {str(ckpt / f'step_{saved:08d}')!r} at step {saved} (" in err  # the restart
    step = preempted_at(lines[1], ckpt)  # the agent's SIGTERM: every worker saved at the same step
    assert step > saved and latest_checkpoint(ckpt).name == f"step_{step:08d}"
    assert not list(ckpt.glob(".*"))  # no temporary directory
    # the metrics keep the first workers' steps up to the checkpoint the restart resumed from: one loss per step,
    # bitwise those of an uninterrupted run
    metrics = [json.loads(row) for row in (tmp_path / "a-out" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m["event"] == "step"]
    assert [m["step"] for m in steps] == list(range(1, step + 1))
    assert [m["loss"] for m in steps] == uninterrupted(tmp_path, step)


def test_ctrl_c_to_torchrun_stops_every_worker_without_a_save(tmp_path):
    proc = torchrun(tmp_path, "d")
    workers = workers_when_saved(proc, tmp_path / "d")
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the agent, which passes it on
    code, err = finish(proc, workers, tmp_path, "d")
    lines = stop_lines(err)
    assert len(lines) == 1, err
    step = int(re.fullmatch(rf"modelpar train: interrupted \(SIGINT\) at step (\d+) of {STEPS}; last complete "
                            r"checkpoint: .*/step_\d+ \(resume continues from there\)", lines[0])[1])
    assert code != 0 and latest_checkpoint(tmp_path / "d").name <= f"step_{step:08d}"
    assert not list((tmp_path / "d").glob(".*"))


def test_kill_9_of_the_agent_ends_every_worker_and_nothing_is_written_after(tmp_path):
    proc = torchrun(tmp_path, "e")
    workers = workers_when_saved(proc, tmp_path / "e")
    proc.kill()  # the workers have no agent left: they die with it (exit_with_parent)
    proc.wait(timeout=60)  # the agent is gone: its exit sent the workers SIGKILL, so none can start another write
    saved = sorted(p.name for p in (tmp_path / "e").iterdir())
    finish(proc, workers, tmp_path, "e")  # the agent and every worker are gone: nothing can write after this
    assert sorted(p.name for p in (tmp_path / "e").iterdir()) == saved
