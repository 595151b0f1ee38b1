"""The checkpoint directory's rules in one process (``CheckpointManager``): what counts, what is pruned,
what a fresh run meets, checksums, a full disk, a reader racing a pruning writer; and, on the shared
two ranks, an asynchronous save that fails on one rank only.

The command-line cases (real runs, damaged and full directories, two runs at once) are in
test_checkpoint_safety_cli.py.
"""

import json
import re
import resource
import threading
import zlib

import pytest
import torch
import torch.distributed as dist

from modelpar.checkpoint import (
    CheckpointManager,
    Shard,
    ShardedState,
    check_fresh,
    checkpoint_problem,
    latest_checkpoint,
    read_full_tensors,
    read_newest,
    save_checkpoint,
    store,
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


def test_saves_through_one_manager_hold_their_own_steps_values(tmp_path, world):
    # from the second save on the plan is reused (ShardSavePlanner): each directory still gets its own files and
    # .metadata, blocking or in the background, and a changed size is planned again
    manager = CheckpointManager(tmp_path, group=world, keep=0)
    try:
        manager.save(1, state(1.0), {"losses": []})
        manager.save_async(2, state(2.0), {"losses": []})
        manager.save_async(3, state(3.0), {"losses": []})
        manager.finish()
        manager.save(4, state(4.0, n=20), {"losses": []})
    finally:
        manager.close()
    assert steps(tmp_path) == [f"step_0000000{s}" for s in (1, 2, 3, 4)]
    for step, n in ((1, 12), (2, 12), (3, 12), (4, 20)):
        path = tmp_path / f"step_0000000{step}"
        assert checkpoint_problem(path) == "" and read_full_tensors(path)["w"].tolist() == [float(step)] * n


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


def test_a_full_disk_under_an_async_save_is_the_same_error_at_the_next_finish(tmp_path, world):
    # sealed (or not) in the background: the error comes from finish, and the previous checkpoint stays
    with tmpfs(tmp_path / "disk", size="400k") as disk:
        manager = CheckpointManager(disk, group=world, keep=0)
        try:
            manager.save_async(1, state(1.0, n=20_000), {"losses": []})
            assert manager.finish() == disk / "step_00000001"
            manager.save_async(2, state(2.0, n=30_000), {"losses": []})
            with pytest.raises(ValueError, match=r"^no space left on device writing checkpoint step 2 to "):
                manager.finish()
        finally:
            manager.close()
        assert steps(disk) == ["step_00000001"]
        assert read_full_tensors(disk / "step_00000001")["w"].tolist() == [1.0] * 20_000


def test_an_async_save_that_close_stops_waiting_for_is_never_sealed(tmp_path, world, monkeypatch):
    manager = CheckpointManager(tmp_path, group=world, keep=0)
    release, read_back = threading.Event(), store._own_crcs

    def held(tmp, rank):  # the write's checksums, read in the writing thread once the test says so
        assert release.wait(60)
        return read_back(tmp, rank)

    monkeypatch.setattr(store, "_own_crcs", held)
    manager.save_async(1, state(1.0), {"losses": []})
    pending = manager._pending
    manager.close(timeout=0.2)  # the write is held: close gives up on it
    release.set()
    error = pending.done.exception(timeout=60)  # rank 0 refused to seal it, and removed it
    assert re.fullmatch(r"writing checkpoint step 1 to .* failed \(RuntimeError: the run closed the checkpoint "
                        r"directory before this save was complete\); the previous checkpoints are kept", str(error))
    assert not store.step_dirs(tmp_path)  # never published: at most its temporary directory is left
    assert steps(tmp_path) == [p.name for p in store.leftovers(tmp_path)]


def _async_save_without_host_memory_on_rank_1(root):
    """Both ranks save 400 MB asynchronously; rank 1's address space has room for 100 MB more: its host copy fails."""
    rank = dist.get_rank()
    big = ShardedState()
    big.add("model.w", Shard.split(torch.full((100_000_000,), 1.0, dtype=torch.float64), 0, rank, 2))
    manager = CheckpointManager(root, group=dist.group.WORLD, keep=0)
    manager.open()
    limits = resource.getrlimit(resource.RLIMIT_AS)
    try:
        manager.save_async(1, state(1.0), {"losses": []})  # a small one first: this save is in flight below
        if rank == 1:
            status = open("/proc/self/status").read()
            mapped = int(re.search(r"VmSize:\s+(\d+) kB", status).group(1)) * 1024
            resource.setrlimit(resource.RLIMIT_AS, (mapped + 100_000_000, limits[1]))
        try:
            manager.save_async(2, big, {"losses": []})
        finally:
            resource.setrlimit(resource.RLIMIT_AS, limits)
        return "saved"
    except ValueError as err:
        return str(err)
    finally:
        manager.close()


def test_an_async_save_whose_host_copy_fails_on_one_rank_is_the_same_error_on_every_rank(c2, tmp_path):
    # the copy is agreed on before any rank starts writing: no rank waits for a write the other never started
    errors = c2.run(_async_save_without_host_memory_on_rank_1, str(tmp_path))
    assert errors[0] == errors[1]
    assert re.fullmatch(r"copying checkpoint step 2 to host memory failed on rank 1 \(RuntimeError: .*can't allocate "
                        r"memory.*\); the previous checkpoints are kept", errors[0])
    assert steps(tmp_path) == ["step_00000001"]  # the save before it completed; nothing of step 2 is left
    assert read_full_tensors(tmp_path / "step_00000001")["w"].tolist() == [1.0] * 12


def test_overwrite_removes_only_modelpar_checkpoints(tmp_path, world):
    # rule "Ours and foreign" (docs/checkpoints.md): --overwrite is refused while a foreign step_<n> folder is
    # there, with nothing removed; without it, every checkpoint of ours goes, valid or damaged
    save(tmp_path, 2, world)
    missing_shard(save(tmp_path, 4, world))
    (tmp_path / "step_00000009").mkdir()
    (tmp_path / "step_00000009" / "results.csv").write_text("the user's")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError, match=r"holds step_00000009, which is not a modelpar checkpoint"):
        CheckpointManager(tmp_path, group=world).open(overwrite=True)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing removed, the lock released
    (tmp_path / "step_00000009" / "results.csv").unlink()
    (tmp_path / "step_00000009").rmdir()
    notes = []
    manager = CheckpointManager(tmp_path, group=world, note=notes.append)
    manager.open(overwrite=True)
    manager.close()
    assert steps(tmp_path) == [] and notes == [
        "removed the 2 checkpoints of an earlier run (--overwrite), newest step_00000004"]


def test_resume_where_no_checkpoint_is_valid_is_refused_naming_them(tmp_path, world):
    # rule "Resume": checkpoints that exist but none valid stop the run; it never starts over on top of them
    missing_shard(save(tmp_path, 2, world))
    zeroed_shard(save(tmp_path, 4, world))
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    manager = CheckpointManager(tmp_path, group=world)
    manager.open(resume=True)
    try:
        with pytest.raises(ValueError, match=rf"^--resume: checkpoint directory {re.escape(repr(str(tmp_path)))} holds "
                                             r"checkpoints but none is valid: step_00000004 \(__0_0.distcp is damaged "
                                             r"\(CRC-32 [0-9a-f]{8}, [0-9a-f]{8} was written\)\), step_00000002 "
                                             r"\(__0_0.distcp is missing\); repair or move them away \(modelpar does "
                                             r"not start over on top of them\)$"):
            manager.choose()
    finally:
        manager.close()
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before


def test_a_save_never_replaces_a_foreign_folder_of_its_step(tmp_path, world):
    # rule "Ours and foreign": a folder that appears under a step's name during a run stays as it is
    save(tmp_path, 2, world)
    (tmp_path / "step_00000003").mkdir()
    (tmp_path / "step_00000003" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"^writing checkpoint step 3 to .* failed \(FileExistsError: "
                                         r"'.*step_00000003' is not a checkpoint \(someone else's folder\): it is left "
                                         r"as it is\); the previous checkpoints are kept$"):
        save(tmp_path, 3, world)
    assert (tmp_path / "step_00000003" / "notes.txt").read_text() == "mine"
    assert steps(tmp_path) == ["step_00000002", "step_00000003"]  # the partial save removed


_ORPHAN = """
import multiprocessing, sys
import torch, torch.distributed as dist
from modelpar.checkpoint import Shard, ShardedState, save_checkpoint
from modelpar.distributed import free_port
from modelpar.distributed.lifeline import watch
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
state = ShardedState()
state.add("model.w", Shard.whole(torch.zeros(8)))
lifeline, launcher = multiprocessing.Pipe(duplex=False)
watch(lifeline)  # as a rank's lifeline thread does, without the thread: no exit but the one under test
save_checkpoint(sys.argv[1], 1, state, {"losses": []}, group=dist.group.WORLD)
launcher.close()  # the launcher is gone (kill -9 closes its end of the pipe the same way)
save_checkpoint(sys.argv[1], 2, state, {"losses": []}, group=dist.group.WORLD, keep=1)
print("saved after the launcher died")
"""


def test_a_rank_whose_launcher_died_publishes_and_prunes_nothing(tmp_path):
    # rule "Launcher killed": after the launcher's death a save in progress is abandoned before it is sealed;
    # the checkpoint before it is neither replaced nor pruned (keep = 1), the torn save is the next run's to remove
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _ORPHAN, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "saved after" not in done.stdout, done.stderr
    names = steps(tmp_path)
    assert names[-1] == "step_00000001" and len(names) == 2 and names[0].startswith(".step_00000002.tmp-"), names
    assert not {"COMPLETE", "meta.json"} & {p.name for p in (tmp_path / names[0]).iterdir()}  # never sealed
    assert latest_checkpoint(tmp_path).name == "step_00000001"


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    from modelpar.checkpoint.lock import DirLock

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    (tmp_path / "LOCK").write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "started": "then"}))
    lock = DirLock(tmp_path)
    assert lock.acquire() == (f"took over the stale lock of pid {pid} on host {socket.gethostname()} (since then), "
                              "which is no longer running")
    assert json.loads((tmp_path / "LOCK").read_text())["pid"] == os.getpid()
    lock.release()
    (tmp_path / "LOCK").write_text(json.dumps({"host": "elsewhere", "pid": pid, "started": "then"}))
    with pytest.raises(ValueError, match=r"has a lock from pid \d+ on host elsewhere \(since then\), another host: "
                                         r"if that run has ended, delete '.*LOCK'"):
        DirLock(tmp_path).acquire()
