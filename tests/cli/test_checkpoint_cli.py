"""The checkpoint directory on the command line: one writer, restarts, damaged checkpoints, bad input, export.

Each `modelpar train` here runs real rank processes (one, a tiny model, a few steps) through
``modelpar.cli.main``; after each, no rank process is left.
"""

import json
import re
import socket
import subprocess
import sys

import pytest

from modelpar.checkpoint import DirLock
from modelpar.cli import main
from modelpar.training.config import TrainConfig
from modelpar.training.resume import _layout
from tests._ranks import rank_processes

TINY = ["--tp", "1", "--pp", "1", "--hidden", "32", "--heads", "2", "--layers", "2", "--seq-len", "16",
        "--batch-size", "4", "--microbatches", "2", "--eval-batches", "1", "--precision", "fp64", "--no-progress"]


def train(capsys, tmp_path, *flags, out="out"):
    """``modelpar train`` with ``flags``: (exit code, stderr lines, summary or None)."""
    code = main(["train", *TINY, "--out", str(tmp_path / out), *flags])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    summary = tmp_path / out / "summary.json"
    assert rank_processes() == []  # every rank of the run has exited
    return code, err, json.loads(summary.read_text()) if code == 0 and summary.exists() else None


def test_a_locked_directory_refuses_a_second_run_at_once(capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    with DirLock(ckpt):
        holder = json.loads((ckpt / "LOCK").read_text())
        code, err, _ = train(capsys, tmp_path, "--steps", "2", "--checkpoint-dir", str(ckpt))
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"modelpar train: error: checkpoint directory {str(ckpt)!r} is in use by pid {holder['pid']} on "
                      f"host {socket.gethostname()} (since {holder['started']}): one run writes a checkpoint directory "
                      "at a time")
    assert sorted(p.name for p in ckpt.iterdir()) == [] and not (tmp_path / "out").exists()  # nothing written


def test_a_crashed_run_leaves_a_directory_the_next_run_starts_in(capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / ".step_00000004.tmp-0badf00d").mkdir(parents=True)  # a save killed mid-write (a save's step_N is
    # renamed whole, so a crash leaves no step_N without its marker; a step_N of no checkpoint is foreign: refused)
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    (ckpt / "LOCK").write_text(json.dumps({"host": socket.gethostname(), "pid": dead, "started": "before"}))
    code, err, summary = train(capsys, tmp_path, "--steps", "2", "--checkpoint-dir", str(ckpt), "--resume")
    assert code == 0, err
    notes = [line for line in err if not line.startswith("modelpar train: 1 local")]
    assert notes == [
        f"modelpar train: warning: took over the stale lock of pid {dead} on host {socket.gethostname()} "
        "(since before), which is no longer running",
        f"modelpar train: removed {str(ckpt / '.step_00000004.tmp-0badf00d')!r}, a checkpoint save that never completed",
        f"modelpar train: no complete checkpoint in {str(ckpt)!r}: starting from step 0",
    ]
    assert summary["start_step"] == 0 and len(summary["losses"]) == 2
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000002"]  # the lock released, the leftover gone


def test_a_truncated_latest_checkpoint_is_skipped_and_the_run_continues_exactly(capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    code, _, full = train(capsys, tmp_path, "--steps", "4", "--checkpoint-every", "2", "--checkpoint-dir", str(ckpt),
                          out="full")
    assert code == 0 and sorted(p.name for p in ckpt.iterdir()) == ["step_00000002", "step_00000004"]
    shard = ckpt / "step_00000004" / "__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])  # a disk that lost the end of the file

    # --resume and a split: the model and optimisation settings come from the checkpoint
    code = main(["train", "--checkpoint-dir", str(ckpt), "--resume", "--tp", "1", "--pp", "2", "--no-progress",
                 "--out", str(tmp_path / "resumed")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 0 and rank_processes() == [], err
    assert f"modelpar train: warning: skipping damaged checkpoint {str(ckpt / 'step_00000004')!r} (__0_0.distcp is " \
           f"{size // 2} bytes, {size} were written)" in err
    assert any(line.startswith(f"modelpar train: resuming from {str(ckpt / 'step_00000002')!r} at step 2 (written by "
                               "t=1, p=1, d=1, 1f1b, v=1; now t=1, p=2, d=1, 1f1b, v=1)") for line in err), err
    resumed = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert resumed["start_step"] == 2 and resumed["config"]["model"] == full["config"]["model"]
    assert resumed["losses"][:2] == full["losses"][:2]
    assert resumed["losses"][2:] == pytest.approx(full["losses"][2:], abs=1e-9, rel=0)  # at p = 2

    # bad input: one line, exit code 2, nothing written, no rank started
    before = sorted(str(p) for p in ckpt.rglob("*"))
    for flags, message in (
        (["--hidden", "64"], rf"checkpoint {re.escape(repr(str(ckpt / 'step_00000004')))} is of a different model: "
                             r"hidden differ \(checkpoint \[32\], this run \[64\]\)"),
        (["--tp", "4"], r"heads \(2\) must be divisible by tp \(4\)"),  # the checkpoint's 2 heads, not the default 4
        (["--pp", "5"], r"p·v = 5 chunks need at least 3 layers, the model has 2"),  # the checkpoint's 2 layers
        (["--schedule", "interleaved", "--pp", "2", "--chunks", "3"], r"p·v = 6 chunks need at least 4 layers, .*"),
        (["--checkpoint-dir", str(shard)], r"checkpoint_dir must be a directory, got '.*__0_0.distcp', which is a file"),
    ):
        code = main(["train", "--checkpoint-dir", str(ckpt), "--resume", "--no-progress", "--out",
                     str(tmp_path / "bad"), *flags])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "\n" not in err and re.fullmatch(f"modelpar train: error: {message}", err), err
    assert sorted(str(p) for p in ckpt.rglob("*")) == before and not (tmp_path / "bad").exists()
    assert rank_processes() == []


def test_export_refuses_what_is_not_a_checkpoint(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    damaged = tmp_path / "damaged" / "step_00000003"
    damaged.mkdir(parents=True)
    (damaged / "meta.json").write_text('{"checkpoint_format": 2}')
    (damaged / "COMPLETE").write_text("{}")
    for path, message in (
        (tmp_path / "empty", rf"{re.escape(repr(str(tmp_path / 'empty')))} is not a checkpoint: no COMPLETE marker and "
                             r"no complete step_N checkpoint inside"),
        (tmp_path / "missing", r"checkpoint '.*missing' does not exist \(expected a checkpoint directory\)"),
        (damaged.parent, r".*damaged' is not a checkpoint: .*; damaged: step_00000003 \(unreadable COMPLETE marker "
                         r"\(no file sizes in it\)\)"),
    ):
        code = main(["export", str(path), "--out", str(tmp_path / "model.safetensors")])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "\n" not in err and re.fullmatch(f"modelpar export: error: {message}.*", err), err
    assert main(["export", str(tmp_path / "empty"), "--out", str(tmp_path / "model.bin")]) == 2
    assert "--out must name a .safetensors file" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged", "empty"]  # nothing written


def test_the_resume_note_names_cp_and_ep_when_used():
    """The note's "written by ... now ..." layouts come from TrainConfig.layout(): cp and ep appear when above 1."""
    assert _layout(TrainConfig(tp=1, cp=2, pp=2, dp=2, ep=2, schedule="zb-v", chunks=2)) == "t=1, cp=2, p=2, d=2, ep=2, zb-v, v=2"
    assert _layout(TrainConfig(tp=2, pp=2, dp=1)) == "t=2, p=2, d=1, 1f1b, v=1"
