"""Elastic restart with a new plan: one `torchrun ... --plan auto --resume` command line on 4, then 3, then 2 workers.

The run on 4 workers is killed (kill -9 of the whole torchrun: a machine lost) after a checkpoint; the same
command on 3 workers is refused in one line (no layout splits the model on 3 ranks), and on 2 it re-plans,
resumes from the newest valid checkpoint with the same global batch, says the old and new layouts and the
steps lost, and trains on. Its losses equal, in float64 and bitwise, those of a run started at the planned
layout from a copy of the same checkpoint by the local launcher (torchrun and the planner are under test).
Three torchruns and one local run in all: marked ``torchrun``.
"""

import json
import os
import re
import shutil
import signal
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from _wait import wait_until

from modelpar.checkpoint import latest_checkpoint, read_meta
from modelpar.training.config import TrainConfig
from modelpar.training.start import rank_threads, run_local

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(600),
              pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not installed")]

STEPS = 60  # enough that the run on 4 workers is still training when it is killed after its step-4 checkpoint
# batch 8, 2 layers, 2 heads: 4 ranks (d=4, d=2·p=2, ...) and 2 split it; 3 divides none of them
COMMAND = ["-m", "modelpar", "train", "--backend", "gloo", "--hidden", "32", "--layers", "2", "--heads", "2",
           "--seq-len", "16", "--batch-size", "8", "--precision", "fp64", "--warmup", "1", "--eval-every", "0",
           "--eval-batches", "1", "--no-progress", "--steps", str(STEPS), "--checkpoint-every", "2",
           "--plan", "auto", "--resume", "--checkpoint-dir", "ck", "--out", "out"]


def torchrun(cwd: Path, nproc: int) -> subprocess.Popen:
    """The same command on ``nproc`` workers, in a session of its own; stderr to ``<nproc>.err``."""
    with open(cwd / f"{nproc}.err", "w") as err:
        return subprocess.Popen(["torchrun", "--nnodes", "1:1", "--max-restarts", "0", "--nproc-per-node", str(nproc),
                                 *COMMAND], cwd=cwd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, "OMP_NUM_THREADS": str(rank_threads(nproc))})


def finished(proc: subprocess.Popen, cwd: Path, nproc: int) -> tuple[int, str]:
    try:
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, (cwd / f"{nproc}.err").read_text()


def step_of(path: Path | None) -> int:
    return int(path.name[5:]) if path is not None else 0


def test_the_same_command_replans_on_fewer_workers_and_resumes_bitwise(tmp_path):
    ck = tmp_path / "ck"
    four = torchrun(tmp_path, 4)
    try:
        wait_until(lambda: step_of(latest_checkpoint(ck)) >= 4, "a checkpoint at step 4 or later",
                   alive=lambda: four.poll() is None)
    finally:
        os.killpg(four.pid, signal.SIGKILL)  # the agent and its workers at once: a machine lost
        four.wait()
    wait_until(lambda: not subprocess.run(["pgrep", "-s", str(four.pid)], capture_output=True).stdout,
               "the killed workers gone")
    resumed = latest_checkpoint(ck)
    k = step_of(resumed)
    assert TrainConfig.from_dict(read_meta(resumed)["config"]).dims.world_size == 4
    trained = [json.loads(line)["step"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
               if line.endswith("}") and json.loads(line)["event"] == "step"]
    shutil.copytree(resumed, tmp_path / "ref-ck" / resumed.name)

    code, err = finished(torchrun(tmp_path, 3), tmp_path, 3)  # refused before any rank trains
    errors = {line for line in err.splitlines() if line.startswith("modelpar train: error")}
    assert code != 0 and errors == {"modelpar train: error: --plan auto: no layout the trainer runs splits this "
                                    "model on 3 ranks (batch 8, 2 layers, 2 heads)"}, err
    assert latest_checkpoint(ck) == resumed

    code, err = finished(torchrun(tmp_path, 2), tmp_path, 2)
    assert code == 0, err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    cfg = TrainConfig.from_dict(read_meta(latest_checkpoint(ck))["config"])  # the layout the planner chose
    assert cfg.dims.world_size == 2 and cfg.batch_size == 8  # re-planned, the global batch kept
    assert re.search(r"modelpar train: plan on \S+ \(\d+ of \d+ layouts fit\): t=1 p=\d d=\d", err), err
    old, new = re.search(rf"modelpar train: resuming from {re.escape(repr(str(Path('ck') / resumed.name)))} at step "
                         rf"{k} \(written by (.*); now (.*)\)", err).groups()
    assert old != new, (old, new)
    lost = [s for s in trained if s > k]
    if lost:  # killed after more steps than its last checkpoint holds: they are trained again, and said so
        assert (f"modelpar train: steps lost: {len(lost)} (steps {k + 1}-{max(lost)} of the stopped run, after its "
                f"last valid checkpoint at step {k}, are trained again)") in err, err
    assert summary["start_step"] == k and len(summary["losses"]) == STEPS

    # the same layout, started by the local launcher from a copy of the checkpoint: bitwise the same losses
    ref = run_local(replace(cfg, plan="none", checkpoint_dir=str(tmp_path / "ref-ck")))
    assert ref.start_step == k
    assert summary["losses"] == ref.losses
