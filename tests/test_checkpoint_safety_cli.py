"""Nothing lost, for real, on the command line: a damaged newest checkpoint, a same-size corrupted
shard, a fresh run into an earlier run's directory, a full disk, two runs on one --out.

Each case checks the exit code, the one line naming the cause, that no checkpoint valid before
is gone, and that ``--resume`` afterwards continues from the newest valid checkpoint. The runs
are real (``modelpar.cli.main``, one rank process, a tiny model in float64).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from modelpar.checkpoint import latest_checkpoint, read_meta
from modelpar.cli import main
from modelpar.commands.preflight import OUT_LOCK
from tests.test_checkpoint_cli import TINY, rank_processes
from tests.tmpfs import resize, tmpfs, used

DEADLINE = 120.0  # s a test waits for another process's run to reach a point


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One token cache for the module's runs: the corpus is tokenized once."""
    return tmp_path_factory.mktemp("cache")


def train(capsys, tmp_path, cache, *flags, out="out"):
    """``modelpar train`` with ``flags``: (exit code, stderr lines, summary or None)."""
    code = main(["train", *TINY, "--out", str(tmp_path / out), "--cache-dir", str(cache), *flags])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    summary = tmp_path / out / "summary.json"
    assert rank_processes() == []
    return code, err, json.loads(summary.read_text()) if code == 0 and summary.exists() else None


def notes(err):
    return [line for line in err if not line.startswith("modelpar train: 1 local")]


def names(ckpt):
    return sorted(p.name for p in ckpt.iterdir())


def test_a_damaged_newest_checkpoint_does_not_make_pruning_delete_the_good_ones(capsys, tmp_path, cache):
    ckpt = tmp_path / "ck"
    code, _, _ = train(capsys, tmp_path, cache, "--steps", "8", "--exit-after", "6", "--checkpoint-every", "2", "--keep", "3",
                       "--checkpoint-dir", str(ckpt))
    assert code == 0 and names(ckpt) == ["step_00000002", "step_00000004", "step_00000006"]
    (ckpt / "step_00000006" / "__0_0.distcp").unlink()

    code, err, summary = train(capsys, tmp_path, cache, "--checkpoint-dir", str(ckpt), "--resume", "--exit-after", "1",
                               "--keep", "1", out="again")
    assert code == 0 and summary["start_step"] == 4, err
    assert notes(err)[0] == (f"modelpar train: warning: skipping damaged checkpoint {str(ckpt / 'step_00000006')!r} "
                             "(__0_0.distcp is missing)")
    assert names(ckpt) == ["step_00000005", "step_00000006"]  # the new one kept; the damaged one never counted

    code, err, summary = train(capsys, tmp_path, cache, "--checkpoint-dir", str(ckpt), "--resume", "--keep", "1",
                               "--checkpoint-every", "2", out="last")  # step 6 written again, whole
    assert code == 0 and summary["start_step"] == 5 and len(summary["losses"]) == 8, err
    assert names(ckpt) == ["step_00000008"] and latest_checkpoint(ckpt).name == "step_00000008"


def test_a_same_size_corrupted_shard_is_caught_by_its_checksum_and_resume_falls_back(capsys, tmp_path, cache):
    ckpt = tmp_path / "ck"
    code, _, full = train(capsys, tmp_path, cache, "--steps", "4", "--checkpoint-every", "2", "--checkpoint-dir", str(ckpt))
    assert code == 0
    shard = ckpt / "step_00000004" / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:  # the f.write(b'\0' * 4096): the size stays, the bytes do not
        f.write(b"\0" * 4096)
    assert shard.stat().st_size == size

    code, err, resumed = train(capsys, tmp_path, cache, "--checkpoint-dir", str(ckpt), "--resume", out="resumed")
    assert code == 0, err
    assert re.fullmatch(rf"modelpar train: warning: skipping damaged checkpoint {re.escape(repr(str(shard.parent)))} "
                        r"\(__0_0.distcp is damaged \(CRC-32 [0-9a-f]{8}, [0-9a-f]{8} was written\)\)", notes(err)[0])
    assert notes(err)[1].startswith(f"modelpar train: resuming from {str(ckpt / 'step_00000002')!r} at step 2")
    assert resumed["start_step"] == 2 and resumed["losses"] == full["losses"]  # the same split: bitwise
    assert latest_checkpoint(ckpt).name == "step_00000004"  # rewritten whole, and valid again


def test_a_fresh_run_into_an_earlier_runs_directory_is_refused_unless_overwrite(capsys, tmp_path, cache):
    ckpt = tmp_path / "ck"
    assert train(capsys, tmp_path, cache, "--steps", "2", "--checkpoint-dir", str(ckpt))[0] == 0
    before = {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")}

    code, err, _ = train(capsys, tmp_path, cache, "--steps", "2", "--checkpoint-dir", str(ckpt), out="second")
    assert code == 2 and err == [
        f"modelpar train: error: checkpoint directory {str(ckpt)!r} holds checkpoints of an earlier run (newest "
        "step_00000002): add --resume to continue it, --overwrite to delete them and start over, or choose another "
        "--checkpoint-dir"]
    assert {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")} == before and not (tmp_path / "second").exists()
    code, err, _ = train(capsys, tmp_path, cache, "--checkpoint-dir", str(ckpt), "--overwrite", "--resume", out="second")
    assert code == 2 and len(err) == 1 and "overwrite (delete the checkpoints and start over) and resume" in err[0]

    code, err, summary = train(capsys, tmp_path, cache, "--steps", "4", "--exit-after", "3", "--seed", "1",
                               "--checkpoint-dir", str(ckpt), "--overwrite", out="second")
    assert code == 0 and summary["start_step"] == 0, err
    assert notes(err) == ["modelpar train: removed the 1 checkpoint of an earlier run (--overwrite), newest "
                          "step_00000002"]
    assert names(ckpt) == ["step_00000003"] and read_meta(ckpt / "step_00000003")["config"]["seed"] == 1

    code, err, summary = train(capsys, tmp_path, cache, "--checkpoint-dir", str(ckpt), "--resume", out="third")
    assert code == 0 and summary["start_step"] == 3 and summary["config"]["optimisation"]["seed"] == 1, err  # continued


def test_a_full_disk_is_one_line_and_the_previous_checkpoint_stays(capsys, tmp_path, cache):
    with tmpfs(tmp_path / "disk", size="16m") as disk:
        ckpt = disk / "ck"
        code, _, _ = train(capsys, tmp_path, cache, "--steps", "6", "--exit-after", "2", "--checkpoint-dir", str(ckpt))
        assert code == 0 and names(ckpt) == ["step_00000002"]
        one = sum(p.stat().st_size for p in (ckpt / "step_00000002").iterdir())
        resize(disk, str(used(disk) + one // 2))  # room for half a checkpoint more

        code, err, _ = train(capsys, tmp_path, cache, "--checkpoint-dir", str(ckpt), "--resume", "--exit-after", "2",
                             "--keep", "1", out="full")
        assert code == 2, err
        assert re.fullmatch(rf"modelpar train: error: \[rank 0\] no space left on device writing checkpoint step 4 "
                            rf"to {re.escape(repr(str(ckpt)))} \(needs ~{one / 1e6:,.1f} MB; the previous checkpoints "
                            r"are kept\)", err[-1]), err
        assert len(notes(err)) == 2 and notes(err)[0].startswith("modelpar train: resuming from")
        assert names(ckpt) == ["step_00000002"] and latest_checkpoint(ckpt).name == "step_00000002"

        resize(disk, "16m")
        code, err, summary = train(capsys, tmp_path, cache, "--checkpoint-dir", str(ckpt), "--resume", out="after")
        assert code == 0 and summary["start_step"] == 2 and len(summary["losses"]) == 6, err


def test_two_runs_on_one_out_do_not_interleave_their_metrics(capsys, tmp_path, cache):
    out = tmp_path / "out"
    first = subprocess.Popen([sys.executable, "-m", "modelpar", "train", *TINY, "--steps", "400", "--out", str(out),
                              "--cache-dir", str(cache)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=os.environ.copy(),
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # even if pytest ignores it
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + DEADLINE
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start training"
            time.sleep(0.05)
        code, err, _ = train(capsys, tmp_path, cache, "--steps", "2")
        holder = json.loads((out / OUT_LOCK).read_text())
        assert code == 2 and err == [
            f"modelpar train: error: output folder (--out) {str(out)!r} is in use by pid {first.pid} on host "
            f"{holder['host']} (since {holder['started']}): one run writes an output folder (--out) at a time"]
    finally:
        first.send_signal(signal.SIGINT)
        _, stderr = first.communicate(timeout=DEADLINE)
    assert first.returncode == 130, stderr
    steps = [m["step"] for m in map(json.loads, metrics.read_text().splitlines()) if m["event"] == "step"]
    assert steps == list(range(1, len(steps) + 1))  # the first run's lines only, each step once
    assert not (out / OUT_LOCK).exists()
    assert Path(out).is_dir() and rank_processes() == []


def test_export_while_a_run_prunes_takes_the_newest_valid_checkpoint(capsys, tmp_path, cache):
    ckpt, model = tmp_path / "ck", tmp_path / "model.safetensors"
    run = subprocess.Popen([sys.executable, "-m", "modelpar", "train", *TINY, "--steps", "10", "--checkpoint-every", "1",
                            "--keep", "1", "--checkpoint-dir", str(ckpt), "--out", str(tmp_path / "out"),
                            "--cache-dir", str(cache)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        deadline = time.monotonic() + DEADLINE
        while latest_checkpoint(ckpt, checksums=False) is None:
            assert run.poll() is None and time.monotonic() < deadline, "the run wrote no checkpoint"
            time.sleep(0.05)
        codes = []
        while run.poll() is None and time.monotonic() < deadline:  # each export races the run's pruning
            codes.append(main(["export", str(ckpt), "--out", str(model)]))
            assert codes[-1] == 0, capsys.readouterr().err
            time.sleep(0.2)  # leave the run some CPU: the race needs it to keep saving and pruning
    finally:
        _, stderr = run.communicate(timeout=DEADLINE)
    assert run.returncode == 0, stderr
    assert codes and set(codes) == {0}
    assert main(["export", str(ckpt), "--out", str(model)]) == 0 and names(ckpt) == ["step_00000010"]
