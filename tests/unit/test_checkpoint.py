"""Checkpoint pieces in one process: boxes of full tensors, DCP resharding, which checkpoint counts, the lock.

The multi-process round trips (every split to every other) are in test_reshard.py, the command
line (locks, restarts, damaged checkpoints, export) in test_checkpoint_cli.py.
"""

import json
import os
import re
import socket
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from modelpar.checkpoint import (
    CheckpointManager,
    DirLock,
    Piece,
    Shard,
    ShardedState,
    check_fresh,
    check_unlocked,
    checkpoint_step,
    latest_checkpoint,
    read_full_tensors,
    read_meta,
)
from modelpar.checkpoint.lock import lock_holder
from modelpar.checkpoint.manager import checkpoint_at
from modelpar.checkpoint.shards import ShardLoadPlanner, ShardSavePlanner, to_save
from modelpar.checkpoint.store import MARKER, is_checkpoint, leftovers, remove_leftovers
from modelpar.checkpoint.store import seal as _seal
from modelpar.tensor_parallel import ParamLayout, shard_tensor
from modelpar.training.state import layout_shard


# --- boxes: where a rank's tensor sits in the full one --------------------------------------------------
def test_fused_blocks_are_one_box_per_block():
    local = torch.zeros(6, 4)  # t = 2, rank 1 of a fused [q; k; v] of 12 rows: rows 2-3, 6-7, 10-11
    shard = Shard.split(local, dim=0, index=1, count=2, blocks=3)
    assert shard.shape == (12, 4)
    assert [(p.offsets, tuple(p.tensor.shape)) for p in shard.pieces] == [((2, 0), (2, 4)), ((6, 0), (2, 4)),
                                                                         ((10, 0), (2, 4))]
    assert all(p.tensor.data_ptr() == local[2 * i].data_ptr() for i, p in enumerate(shard.pieces))  # views
    row = Shard.split(torch.zeros(4, 3), dim=1, index=2, count=4)  # a row-parallel weight, t = 4
    assert row.shape == (4, 12) and [p.offsets for p in row.pieces] == [(0, 6)]


def test_replicated_shards_follow_the_layout():
    # grouped-query key/value heads: t = 4 ranks, 2 distinct parts, consecutive ranks share one
    for rank, offsets in ((0, [(0,), (4,)]), (1, [(0,), (4,)]), (2, [(2,), (6,)]), (3, [(2,), (6,)])):
        layout = ParamLayout(dim=0, blocks=2, replicas=2, rank=rank, world=4)
        assert (layout.shard, layout.shards) == (rank // 2, 2)
        assert [p.offsets for p in layout_shard(torch.zeros(4), layout).pieces] == offsets
    assert layout_shard(torch.zeros(3), ParamLayout(dim=None, rank=1, world=2)).pieces[0].offsets == (0,)


def test_a_name_held_twice_is_saved_once_and_loaded_into_both():
    state, first, second = ShardedState(), torch.zeros(2, 3), torch.ones(2, 3)
    state.add("model.embed.word.weight", Shard.whole(first))
    state.add("model.embed.word.weight", Shard.whole(second))  # a tied head's copy on the same rank
    assert len(state) == 1 and state.shards["model.embed.word.weight"].pieces[0].tensor is first
    first.fill_(7.0)
    state.fill_copies()
    assert torch.equal(second, first)
    with pytest.raises(ValueError, match=r"added twice with different layouts: full shapes \(2, 3\) and \(4, 3\)"):
        state.add("model.embed.word.weight", Shard.split(torch.zeros(2, 3), 0, 1, 2))


def _dcp_save(shards, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # one process, no process group: what we mean
        dcp.save(to_save(shards), storage_writer=dcp.FileSystemWriter(str(path)), planner=ShardSavePlanner(),
                 no_dist=True)


def _dcp_load(shards, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(shards, storage_reader=dcp.FileSystemReader(str(path)), planner=ShardLoadPlanner(), no_dist=True)


def test_dcp_moves_boxes_from_any_split_to_any_other(tmp_path):
    qkv = torch.arange(24 * 2, dtype=torch.float64).view(24, 2)  # fused [q; k; v], 8 rows each
    ln = torch.arange(5, dtype=torch.float64)
    saved = [Shard.split(shard_tensor(qkv, 0, r, 2, 3), 0, r, 2, blocks=3) for r in range(2)]  # written at t = 2
    _dcp_save({"qkv": Shard((24, 2), saved[0].pieces + saved[1].pieces), "ln": Shard.whole(ln),
               "step": Shard.whole(torch.tensor(3.0))}, tmp_path)
    for rank in range(4):  # read at t = 4: rank r wants rows 2r..2r+1 of each block
        mine, ln_copy, step = torch.zeros(6, 2, dtype=torch.float64), torch.zeros(5, dtype=torch.float64), torch.zeros(())
        _dcp_load({"qkv": Shard.split(mine, 0, rank, 4, blocks=3), "ln": Shard.whole(ln_copy),
                   "step": Shard.whole(step)}, tmp_path)
        assert torch.equal(mine, shard_tensor(qkv, 0, rank, 4, 3)) and torch.equal(ln_copy, ln) and step.item() == 3.0
    whole = torch.zeros(24, 2, dtype=torch.float64)  # read on one process
    _dcp_load({"qkv": Shard.whole(whole)}, tmp_path)
    assert torch.equal(whole, qkv)


def _plan(planners, states):
    """One DCP planning of ``states`` (rank r's ``{name: Shard}``) by ``planners`` (rank 0 coordinates), by hand:
    the local plans sent, each rank's final plan, the metadata."""
    sent = []
    for rank, (planner, shards) in enumerate(zip(planners, states)):
        planner.set_up_planner(to_save(shards), is_coordinator=rank == 0)
        sent.append(planner.create_local_plan())
    back, metadata = planners[0].create_global_plan(sent)
    return sent, [planner.finish_plan(plan) for planner, plan in zip(planners, back)], metadata


def _two_ranks(value, rows=4):
    """Rank r: half r of a (2·rows,) tensor and a replicated scalar (de-duplicated: one rank writes it)."""
    full = torch.full((2 * rows,), value, dtype=torch.float64)
    return [{"w": Shard.split(full[r * rows:(r + 1) * rows].clone(), 0, r, 2), "b": Shard.whole(torch.tensor(value))}
            for r in range(2)]


def test_an_unchanged_save_plan_is_sent_empty_and_the_last_global_plan_reused():
    planners = [ShardSavePlanner(), ShardSavePlanner()]
    sent, first, metadata = _plan(planners, _two_ranks(1.0))
    assert [plan.planner_data for plan in sent] == [None, None] and all(plan.items for plan in sent)
    assert sorted((item.index.fqn, tuple(item.index.offset)) for plan in first for item in plan.items) == \
        [("b", ()), ("w", (0,)), ("w", (4,))]  # the replicated scalar written once
    sent, again, same = _plan(planners, _two_ranks(2.0))  # new values, the same boxes: nothing planned again
    assert [(plan.items, plan.planner_data) for plan in sent] == [([], "modelpar: as last time")] * 2
    assert again == first and same is metadata
    states = _two_ranks(3.0)
    states[1]["c"] = Shard.whole(torch.zeros(3, dtype=torch.float64))  # an entry only rank 1 holds (ZeRO-1's kind)
    sent, changed, remade = _plan(planners, states)
    assert [plan.planner_data for plan in sent] == ["modelpar: as last time", None]  # rank 0's: the coordinator's copy
    assert remade is not metadata and sorted(remade.state_dict_metadata) == ["b", "c", "w"]
    assert [item.index.fqn for item in changed[1].items if item.index.fqn == "c"] == ["c"]
    assert [planner.plan for planner in planners] == changed


def test_a_rank_that_sends_an_unchanged_plan_the_coordinator_lacks_is_an_error():
    planners = [ShardSavePlanner(), ShardSavePlanner()]
    _plan(planners, _two_ranks(1.0))
    planners[0] = ShardSavePlanner()  # a coordinator that forgot (a save failed and it was replaced alone)
    with pytest.raises(RuntimeError, match="the ranks' plan caches disagree"):
        _plan(planners, _two_ranks(2.0))


# --- which checkpoint counts -----------------------------------------------------------------------------
def _checkpoint(root, step, weight=None):
    """A complete checkpoint as one process would write it: DCP files, meta.json, the marker."""
    d = root / f"step_{step:08d}"
    weight = torch.full((4, 3), float(step), dtype=torch.float64) if weight is None else weight
    _dcp_save({"model.w": Shard.whole(weight), "optim.w.step": Shard.whole(torch.tensor(float(step)))}, d)
    _seal(d, step, {"config": {"tp": 1}, "losses": []})
    return d


def test_latest_is_the_newest_complete_step(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None and latest_checkpoint(tmp_path) is None
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 10)
    (tmp_path / "step_00000012").mkdir()  # no marker: a copy someone interrupted
    (tmp_path / ".step_00000014.tmp-1234abcd").mkdir()  # a torn write, never renamed
    (tmp_path / "step_notanumber").mkdir()
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step_00000010" and checkpoint_step(latest) == 10
    assert read_meta(latest)["step"] == 10 and read_meta(latest)["checkpoint_format"] == 2
    assert torch.equal(read_full_tensors(latest)["w"], torch.full((4, 3), 10.0, dtype=torch.float64))


@pytest.mark.parametrize("damage, reason", [
    (lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:-10]),
     r"__0_0.distcp is \d+ bytes, \d+ were written"),
    (lambda d: (d / "__0_0.distcp").unlink(), r"__0_0.distcp is missing"),
    (lambda d: (d / ".metadata").write_bytes(b"\0" * (d / ".metadata").stat().st_size), r"unreadable DCP metadata"),
    (lambda d: (d / "meta.json").write_text("{not json"), r"meta.json is 9 bytes, \d+ were written"),
    # rule "Valid" (docs/checkpoints.md): the marker is checked before the format, so a meta.json replaced by {}
    # is damage, not "predates resharding", and a same-size edit is caught by meta.json's CRC-32
    (lambda d: (d / "meta.json").write_text("{}"), r"meta.json is 2 bytes, \d+ were written"),
    (lambda d: _edit_meta(d, '"tp": 1', '"tp": 4'), r"meta.json is damaged \(CRC-32 [0-9a-f]{8}, [0-9a-f]{8} was written\)"),
    (lambda d: (d / MARKER).write_text("[]"), r"unreadable COMPLETE marker"),
])
def test_a_damaged_latest_checkpoint_is_skipped_for_the_previous_one(tmp_path, damage, reason):
    _checkpoint(tmp_path, 2)
    damage(_checkpoint(tmp_path, 4))
    skipped = []
    assert latest_checkpoint(tmp_path, skipped).name == "step_00000002"
    assert [p.name for p, _ in skipped] == ["step_00000004"] and re.search(reason, skipped[0][1]), skipped


def _edit_meta(path, old, new):
    """Change ``meta.json`` in place, keeping its size: only its checksum can tell."""
    text = (path / "meta.json").read_text()
    assert old in text and len(old) == len(new)
    (path / "meta.json").write_text(text.replace(old, new))


def test_a_same_size_edit_of_meta_json_is_damage_even_without_checksums(tmp_path):
    # rule "Valid": meta.json's CRC-32 is checked always (the launcher reads a resumed run's settings from it)
    _checkpoint(tmp_path, 2)
    _edit_meta(_checkpoint(tmp_path, 4), '"tp": 1', '"tp": 4')
    skipped = []
    assert latest_checkpoint(tmp_path, skipped, checksums=False).name == "step_00000002"
    assert re.fullmatch(r"meta.json is damaged \(CRC-32 [0-9a-f]{8}, [0-9a-f]{8} was written\)", skipped[0][1])


def test_a_named_step_gets_the_checks_a_directory_gets(tmp_path):
    # rule "Export": a named step_N is checked as a directory's are; a damaged one is refused, never read
    _checkpoint(tmp_path, 2)
    newest = _checkpoint(tmp_path, 4)
    with open(newest / "__0_0.distcp", "r+b") as f:  # one byte flipped, the size unchanged
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    with pytest.raises(ValueError, match=rf"^checkpoint {re.escape(repr(str(newest)))} is damaged \(__0_0.distcp is "
                                         r"damaged \(CRC-32 [0-9a-f]{8}, [0-9a-f]{8} was written\)\): give another step, "
                                         rf"or the directory {re.escape(repr(str(tmp_path)))} for its newest valid"):
        checkpoint_at(newest)
    assert checkpoint_at(tmp_path / "step_00000002") == tmp_path / "step_00000002"
    skipped = []
    assert checkpoint_at(tmp_path, skipped) == tmp_path / "step_00000002" and [p for p, _ in skipped] == [newest]


def test_a_step_folder_that_is_not_a_checkpoint_is_foreign_and_refuses_every_writer(tmp_path):
    # rule "Ours and foreign": a step_<n> folder without a marker, meta.json or .metadata is someone else's
    _checkpoint(tmp_path, 2)
    (tmp_path / "step_00000007").mkdir()
    (tmp_path / "step_00000007" / "notes.txt").write_text("mine")
    assert is_checkpoint(tmp_path / "step_00000002") and not is_checkpoint(tmp_path / "step_00000007")
    for resume, overwrite in ((False, False), (True, False), (False, True)):
        with pytest.raises(ValueError, match=rf"^checkpoint directory {re.escape(repr(str(tmp_path)))} holds "
                                             r"step_00000007, which is not a modelpar checkpoint \(no COMPLETE, "
                                             r"meta.json or .metadata in it\): modelpar writes and removes only its "
                                             r"own checkpoints; move it out, or choose another --checkpoint-dir$"):
            check_fresh(tmp_path, resume=resume, overwrite=overwrite)
    assert latest_checkpoint(tmp_path).name == "step_00000002"  # readers pass it by


def test_a_checkpoint_of_the_older_format_says_it_predates_resharding(tmp_path):
    d = tmp_path / "step_00000003"  # the format before layout-free checkpoints: keys per tensor-parallel shard
    d.mkdir()
    (d / "meta.json").write_text(json.dumps({"step": 3, "tp": 2, "chunks_used": 1}))
    (d / MARKER).write_text("3\n")
    assert latest_checkpoint(tmp_path) == d  # not skipped as damaged: loading it must say why it cannot
    with pytest.raises(ValueError, match=r"^checkpoint '.*step_00000003' predates resharding \(it stores "
                                         r"tensor-parallel shards, not full tensors\) and cannot be loaded"):
        read_meta(d)
    (d / MARKER).unlink()
    with pytest.raises(ValueError, match=r"is not a complete checkpoint \(no COMPLETE marker\)"):
        read_meta(d)


def test_prune_keeps_the_newest_and_drops_leftovers(tmp_path):
    for step in (1, 2, 3, 4):
        _checkpoint(tmp_path, step)
    (tmp_path / ".step_00000005.tmp-0000").mkdir()
    (tmp_path / ".step_00000002.old-0000").mkdir()
    (tmp_path / "notes.txt").write_text("kept")
    assert [p.name for p in leftovers(tmp_path)] == [".step_00000002.old-0000", ".step_00000005.tmp-0000"]
    CheckpointManager(tmp_path, keep=2).prune()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "step_00000003", "step_00000004"]
    CheckpointManager(tmp_path, keep=0).prune()  # keep everything
    assert len(list(tmp_path.iterdir())) == 3 and remove_leftovers(tmp_path) == []


# --- one writer --------------------------------------------------------------------------------------------
def test_a_held_lock_refuses_a_second_writer_and_names_the_holder(tmp_path):
    assert lock_holder(tmp_path) is None
    with DirLock(tmp_path):
        holder = json.loads((tmp_path / "LOCK").read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        named = f"pid {os.getpid()} on host {socket.gethostname()} (since {holder['started']})"
        assert lock_holder(tmp_path) == named
        with pytest.raises(ValueError, match=rf"^checkpoint directory '.*' is in use by {re.escape(named)}: one run writes"):
            DirLock(tmp_path).acquire()  # flock: another open file, even in this process
        with pytest.raises(ValueError, match="is in use by"):
            check_unlocked(tmp_path)
    assert not (tmp_path / "LOCK").exists() and lock_holder(tmp_path) is None
    check_unlocked(tmp_path)



def test_piece_is_a_box_and_its_data():
    piece = Piece((2, 0), torch.ones(2, 3))
    assert Shard((4, 3), [piece]).piece_at((2, 0)) is piece
    with pytest.raises(KeyError):
        Shard((4, 3), [piece]).piece_at((0, 0))
