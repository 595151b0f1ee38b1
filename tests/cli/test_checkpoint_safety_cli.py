"""Nothing lost, for real, on the command line: a damaged newest checkpoint, a same-size corrupted
shard, a fresh run into an earlier run's directory, a full disk, two runs on one --out.

Each case checks the exit code, the one line naming the cause, that no checkpoint valid before
is gone, and that ``--resume`` afterwards continues from the newest valid checkpoint. The runs
are real (``modelpar.cli.main``, one rank process, a tiny model in float64).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from modelpar.checkpoint import latest_checkpoint, read_meta
from modelpar.cli import main
from modelpar.commands.preflight import OUT_LOCK
from tests._ranks import rank_processes
from tests._signals import CTRL_C_DEFAULT
from tests.cli.test_checkpoint_cli import TINY
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
                             **CTRL_C_DEFAULT)
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


# --- issue 35: a refused run writes nothing; damage and foreign folders are never passed over in silence ---
@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache):
    """One byte-level run's checkpoint directory (steps 2 and 4), copied by each test that damages it."""
    root = tmp_path_factory.mktemp("trained")
    assert main(["train", *TINY, "--steps", "4", "--checkpoint-every", "2", "--checkpoint-dir", str(root / "ck"),
                 "--out", str(root / "out"), "--cache-dir", str(cache)]) == 0
    return root / "ck"


def copy(trained, tmp_path, name="ck"):
    return Path(shutil.copytree(trained, tmp_path / name))


def listing(*folders):
    """Every path under ``folders`` with its size and modification time: equal before and after means untouched
    (the folders' own times aside: --out's lock comes and goes while a run is checked)."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for folder in folders for p in folder.rglob("*")}


def flip_a_byte(path, offset=100):
    """One byte of ``path`` changed in place: the size stays, only the checksum can tell."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def one_line(capsys, command):
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip().removeprefix(f"modelpar {command}: error: ")


def test_a_refused_resume_writes_nothing(capsys, tmp_path, cache, trained):
    # rule "A refused run writes nothing" (docs/checkpoints.md): the resume check comes before tokenizer.json
    ckpt, out = copy(trained, tmp_path), tmp_path / "out"
    out.mkdir()
    before = listing(ckpt, out)
    code = main(["train", *TINY, "--checkpoint-dir", str(ckpt), "--resume", "--tokenizer", "bpe", "--vocab-size", "300",
                 "--out", str(out), "--cache-dir", str(cache)])
    assert code == 2 and one_line(capsys, "train") == (
        f"checkpoint {str(ckpt / 'step_00000004')!r} is of a different model: vocab_size differ (checkpoint [256], "
        "this run [300])")
    assert listing(ckpt, out) == before and not (ckpt / "tokenizer.json").exists() and rank_processes() == []


def test_resume_where_every_checkpoint_is_damaged_stops_naming_them(capsys, tmp_path, cache, trained):
    # rule "Resume": checkpoints exist, none valid: exit 2 naming them, nothing started or written
    ckpt = copy(trained, tmp_path)
    flip_a_byte(ckpt / "step_00000004" / "__0_0.distcp")
    (ckpt / "step_00000002" / "__0_0.distcp").unlink()
    before = listing(ckpt)
    code, err, _ = train(capsys, tmp_path, cache, "--checkpoint-dir", str(ckpt), "--resume")
    assert code == 2 and len(err) == 1 and re.fullmatch(
        rf"modelpar train: error: --resume: checkpoint directory {re.escape(repr(str(ckpt)))} holds checkpoints but none "
        r"is valid: step_00000004 \(__0_0.distcp is damaged \(CRC-32 [0-9a-f]{8}, [0-9a-f]{8} was written\)\), "
        r"step_00000002 \(__0_0.distcp is missing\); repair or move them away \(modelpar does not start over on top "
        r"of them\)", err[0]), err
    assert listing(ckpt) == before and not (tmp_path / "out").exists()


def test_overwrite_leaves_a_folder_that_is_not_a_checkpoint(capsys, tmp_path, cache, trained):
    # rule "Ours and foreign": --overwrite removes modelpar checkpoints only; a step_<n> of the user's refuses the run
    ckpt = copy(trained, tmp_path)
    (ckpt / "step_00000007").mkdir()
    (ckpt / "step_00000007" / "notes.txt").write_text("mine")
    before = listing(ckpt)
    code, err, _ = train(capsys, tmp_path, cache, "--checkpoint-dir", str(ckpt), "--overwrite")
    assert code == 2 and err == [
        f"modelpar train: error: checkpoint directory {str(ckpt)!r} holds step_00000007, which is not a modelpar "
        "checkpoint (no COMPLETE, meta.json or .metadata in it): modelpar writes and removes only its own checkpoints; "
        "move it out, or choose another --checkpoint-dir"]
    assert listing(ckpt) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, message", [
    (["--exit-after", "2"], "--exit-after 2 stops with a checkpoint, which needs --checkpoint-dir (where to write it), "
                            "got none"),
    (["--overwrite"], "--overwrite deletes the checkpoints in --checkpoint-dir, which is not given"),
])
def test_checkpoint_flags_without_a_checkpoint_dir_are_refused(capsys, tmp_path, flags, message):
    # rule "Flags": --exit-after promises a checkpoint, --overwrite names checkpoints to delete: both need the directory
    assert main(["train", *TINY, "--out", str(tmp_path / "out"), *flags]) == 2
    assert one_line(capsys, "train") == message and list(tmp_path.iterdir()) == []


def test_export_and_generate_check_a_named_step_and_say_which_step_they_took(capsys, tmp_path, trained):
    # rule "Export": a named step_N gets the directory's checks; a directory's damaged newest is skipped aloud
    ckpt, model = copy(trained, tmp_path), tmp_path / "model.safetensors"
    newest = ckpt / "step_00000004"
    flip_a_byte(newest / "__0_0.distcp")
    for command in (["export", str(newest), "--out", str(model)], ["generate", str(newest), "--prompt", "a"]):
        assert main(command) == 2
        assert re.fullmatch(rf"checkpoint {re.escape(repr(str(newest)))} is damaged \(__0_0.distcp is damaged "
                            rf"\(CRC-32 [0-9a-f]{{8}}, [0-9a-f]{{8}} was written\)\): give another step, or the "
                            rf"directory {re.escape(repr(str(ckpt)))} for its newest valid checkpoint",
                            one_line(capsys, command[0]))
    shard = newest / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])  # truncated: the traceback
    assert main(["export", str(newest), "--out", str(model)]) == 2
    assert one_line(capsys, "export").endswith("(__0_0.distcp is 1000 bytes, "
                                               f"{trained.joinpath('step_00000004', '__0_0.distcp').stat().st_size} "
                                               f"were written): give another step, or the directory {str(ckpt)!r} "
                                               "for its newest valid checkpoint")
    assert not model.exists()
    assert main(["export", str(ckpt), "--out", str(model)]) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"modelpar export: warning: took {str(ckpt / 'step_00000002')!r} (step 2), the newest valid checkpoint; "
        f"skipped damaged {str(newest)!r} (__0_0.distcp is 1000 bytes, "
        f"{trained.joinpath('step_00000004', '__0_0.distcp').stat().st_size} were written)"]
    assert json.loads(model.with_name("model.json").read_text()) == read_meta(ckpt / "step_00000002")["config"]["model"]


def test_a_newest_meta_json_replaced_or_edited_is_damage_not_settings(capsys, tmp_path, cache, trained):
    # rule "Valid": integrity before format; meta.json's CRC-32 always checked, also before the launcher reads settings
    ckpt, model = copy(trained, tmp_path), tmp_path / "model.safetensors"
    (ckpt / "step_00000004" / "meta.json").write_text("{}")
    assert main(["export", str(ckpt), "--out", str(model)]) == 0
    assert "skipped damaged" in capsys.readouterr().err and "predates" not in capsys.readouterr().err
    meta = ckpt / "step_00000004" / "meta.json"
    meta.write_text(trained.joinpath("step_00000004", "meta.json").read_text().replace('"lr": 0.003', '"lr": 0.004'))
    assert meta.stat().st_size == trained.joinpath("step_00000004", "meta.json").stat().st_size
    code, err, summary = train(capsys, tmp_path, cache, "--checkpoint-dir", str(ckpt), "--resume", "--exit-after", "1",
                               "--keep", "0")
    assert code == 0 and summary["start_step"] == 2 and summary["config"]["optimisation"]["lr"] == 0.003, err
    assert re.fullmatch(rf"modelpar train: warning: skipping damaged checkpoint {re.escape(repr(str(meta.parent)))} "
                        r"\(meta.json is damaged \(CRC-32 [0-9a-f]{8}, [0-9a-f]{8} was written\)\)", notes(err)[0]), err


def test_an_export_folder_holds_one_exports_companions(capsys, tmp_path, trained):
    # rule "Export": the files beside --out are the export's; a stale tokenizer.json of the export it replaces is
    # removed, another one (another export's, the user's) refuses the export, and generate checks the one it finds
    bpe = copy(trained, tmp_path, "bpe")
    (bpe / "tokenizer.json").write_text('{"a run": "with its own tokenizer"}')
    folder = tmp_path / "export"
    folder.mkdir()
    model = folder / "model.safetensors"
    assert main(["export", str(bpe), "--out", str(model)]) == 0 and (folder / "tokenizer.json").exists()
    assert main(["export", str(trained), "--out", str(model)]) == 0  # byte tokens: the earlier tokenizer goes
    assert sorted(p.name for p in folder.iterdir()) == ["model.json", "model.safetensors"]
    capsys.readouterr()
    assert main(["generate", str(model), "--prompt", "a", "--max-new-tokens", "2", "--device", "cpu"]) == 0

    (folder / "tokenizer.json").write_text('{"the user\'s": 1}')
    assert main(["generate", str(model), "--prompt", "a", "--max-new-tokens", "2", "--device", "cpu"]) == 2
    assert one_line(capsys, "generate") == (
        f"{str(folder / 'tokenizer.json')!r} is not the tokenizer of {str(model)!r}, which was exported with byte "
        "tokens (no tokenizer.json): it is another export's; move it away, or export again")
    before = listing(folder)
    assert main(["export", str(trained), "--out", str(folder / "other.safetensors")]) == 2
    assert one_line(capsys, "export") == (
        f"--out: {str(folder / 'tokenizer.json')!r} is not the tokenizer.json of this export nor of the earlier "
        f"export to {str(folder / 'other.safetensors')!r} (another export's in the same folder, or a file of yours), "
        "and modelpar reads it with the model beside it: export to a folder of its own, or move it away")
    assert listing(folder) == before


@pytest.mark.parametrize("options, error", [("size=64k,ro", "Read-only file system"),
                                            ("size=64k", "No space left on device")])
def test_export_to_a_read_only_or_full_file_system_is_one_line(capsys, tmp_path, trained, options, error):
    # rule "Export": a write the file system refuses is one line naming the file, and leaves nothing behind
    size, _, read_only = options.partition(",")
    with tmpfs(tmp_path / "disk", size=size.removeprefix("size="), read_only=bool(read_only)) as disk:
        assert main(["export", str(trained), "--out", str(disk / "model.safetensors")]) == 2
        assert one_line(capsys, "export") == f"{str(disk / 'model.safetensors')!r}: {error}"
        assert list(disk.iterdir()) == []
