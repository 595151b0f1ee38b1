"""The checkpoint directory's rules in one process (``CheckpointManager``): what counts, what is pruned,
what a fresh run meets, checksums, a full disk, a reader racing a pruning writer.

The command-line cases (real runs, damaged and full directories, two runs at once) are in
test_checkpoint_safety_cli.py.
"""

import json
import re
import zlib

import pytest
import torch
import torch.distributed as dist

from modelpar.checkpoint import (
    CheckpointManager,
    Shard,
    ShardedState,
    check_fresh,
    latest_checkpoint,
    read_full_tensors,
    read_newest,
    save_checkpoint,
)
from modelpar.checkpoint.store import MARKER
from modelpar.distributed import free_port
from tests.tmpfs import tmpfs


@pytest.fixture(scope="module")
def world():
    """This process as a world of one (gloo): the collective save and open run here."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def state(value: float, n: int = 12) -> ShardedState:
    s = ShardedState()
    s.add("model.w", Shard.whole(torch.full((n,), value, dtype=torch.float64)))
    return s


def save(root, step, world, keep=0, n=12):
    return save_checkpoint(root, step, state(float(step), n), {"losses": []}, group=world, keep=keep)


def steps(root):
    return sorted(p.name for p in root.iterdir())


def missing_shard(path):
    (path / "__0_0.distcp").unlink()


def zeroed_shard(path):
    """The same size, other bytes: only the checksum can tell."""
    shard = path / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.write(b"\0" * min(4096, size))
    assert shard.stat().st_size == size


def test_the_marker_holds_every_files_size_and_crc32(tmp_path, world):
    path = save(tmp_path, 1, world)
    marker = json.loads((path / MARKER).read_text())
    files = {p.name for p in path.iterdir()} - {MARKER}
    assert set(marker["files"]) == set(marker["crc32"]) == files == {".metadata", "__0_0.distcp", "meta.json"}
    for name in files:
        data = (path / name).read_bytes()
        assert marker["files"][name] == len(data) and marker["crc32"][name] == zlib.crc32(data)


@pytest.mark.parametrize("damage, reason", [
    (missing_shard, r"__0_0.distcp is missing"),
    (zeroed_shard, r"__0_0.distcp is damaged \(CRC-32 [0-9a-f]{8}, [0-9a-f]{8} was written\)"),
])
def test_pruning_counts_only_valid_checkpoints(tmp_path, world, damage, reason):
    # the case: steps 2, 4, 6 kept; 6 damaged; a resumed run (from 4) writes 5 with keep = 1
    for step in (2, 4, 6):
        save(tmp_path, step, world)
    damage(tmp_path / "step_00000006")
    skipped = []
    assert latest_checkpoint(tmp_path, skipped).name == "step_00000004"
    assert re.fullmatch(reason, skipped[0][1]), skipped
    save(tmp_path, 5, world, keep=1)
    # the new one kept, the older valid ones pruned, the damaged one neither counted nor removed
    assert steps(tmp_path) == ["step_00000005", "step_00000006"]
    assert latest_checkpoint(tmp_path).name == "step_00000005"
    assert read_full_tensors(tmp_path / "step_00000005")["w"].tolist() == [5.0] * 12


def test_the_default_keep_keeps_the_two_newest_valid_ones(tmp_path, world):
    for step in (2, 4, 6):
        save(tmp_path, step, world)
    missing_shard(tmp_path / "step_00000006")
    save(tmp_path, 5, world, keep=2)
    assert steps(tmp_path) == ["step_00000004", "step_00000005", "step_00000006"]


def test_the_checkpoint_just_written_always_stays(tmp_path, world):
    save(tmp_path, 9, world)  # a newer valid one (a run resumed elsewhere): keep = 1 must not drop the new one
    save(tmp_path, 3, world, keep=1)
    assert steps(tmp_path) == ["step_00000003", "step_00000009"]


def test_a_fresh_run_is_refused_where_checkpoints_are_and_overwrite_removes_them(tmp_path, world):
    check_fresh(tmp_path, resume=False, overwrite=False)  # empty: fine
    save(tmp_path, 2, world)
    save(tmp_path, 4, world)
    with pytest.raises(ValueError, match=rf"^checkpoint directory {re.escape(repr(str(tmp_path)))} holds checkpoints "
                                         r"of an earlier run \(newest step_00000004\): add --resume to continue it, "
                                         r"--overwrite to delete them and start over, or choose another "
                                         r"--checkpoint-dir$"):
        CheckpointManager(tmp_path, group=world).open()
    assert steps(tmp_path) == ["step_00000002", "step_00000004"]  # untouched, and the lock released
    resuming = CheckpointManager(tmp_path, group=world)
    resuming.open(resume=True)  # resuming is fine
    resuming.close()
    notes = []
    manager = CheckpointManager(tmp_path, group=world, note=notes.append)
    manager.open(overwrite=True)
    assert steps(tmp_path) == ["LOCK"] and notes == [
        "removed the 2 checkpoints of an earlier run (--overwrite), newest step_00000004"]
    manager.close()


def test_a_reader_takes_the_next_newest_if_its_checkpoint_is_pruned_underneath(tmp_path, world):
    save(tmp_path, 2, world)
    save(tmp_path, 4, world)
    seen = []

    def read(path):
        seen.append(path.name)
        if len(seen) == 1:  # a writer saves step 6 and prunes to one while we read step 4
            save(tmp_path, 6, world, keep=1)
        return read_full_tensors(path)["w"][0].item()

    assert read_newest(tmp_path, read) == 6.0 and seen == ["step_00000004", "step_00000006"]
    assert steps(tmp_path) == ["step_00000006"]

    def pruned(path):
        save(tmp_path, 8, world, keep=1)
        return read_full_tensors(path)

    with pytest.raises(ValueError, match=r"checkpoint '.*step_00000006' was removed while it was read \(a run "
                                         r"writing '.*' pruned it\): try again"):
        read_newest(tmp_path / "step_00000006", pruned)  # one named step: nothing else to take


def test_a_full_disk_keeps_the_previous_checkpoint_and_removes_the_partial_one(tmp_path, world):
    with tmpfs(tmp_path / "disk", size="400k") as disk:
        first = save(disk, 1, world, n=20_000)  # 160 kB of float64
        with pytest.raises(ValueError, match=rf"^no space left on device writing checkpoint step 2 to "
                                             rf"{re.escape(repr(str(disk)))} \(needs ~0.2 MB; the previous "
                                             r"checkpoints are kept\)$"):
            save(disk, 2, world, n=30_000)
        assert steps(disk) == ["step_00000001"]  # no partial directory left
        assert latest_checkpoint(disk) == first
        assert read_full_tensors(first)["w"].tolist() == [1.0] * 20_000
