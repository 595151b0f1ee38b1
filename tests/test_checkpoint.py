"""Which checkpoint directory counts as complete (file level; the DCP round trips run in test_train)."""

import json

import pytest

from modelpar.checkpoint import MARKER, _prune, checkpoint_step, latest_checkpoint, read_meta


def _complete(root, step, meta=None):
    d = root / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps(meta or {"step": step}))
    (d / MARKER).write_text(f"{step}\n")
    return d


def test_latest_is_the_highest_complete_step(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    _complete(tmp_path, 2)
    _complete(tmp_path, 10)
    (tmp_path / "step_00000012").mkdir()  # no marker: a copy someone interrupted
    (tmp_path / ".step_00000014.tmp-1234abcd").mkdir()  # a torn write, never renamed
    (tmp_path / "step_notanumber").mkdir()
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step_00000010" and checkpoint_step(latest) == 10


def test_read_meta_refuses_an_incomplete_checkpoint(tmp_path):
    d = _complete(tmp_path, 3, {"step": 3, "seed": 7})
    assert read_meta(d) == {"step": 3, "seed": 7}
    (d / MARKER).unlink()
    with pytest.raises(ValueError, match=r"is not a complete checkpoint \(no COMPLETE marker\)"):
        read_meta(d)


def test_prune_keeps_the_newest_and_drops_leftovers(tmp_path):
    for step in (1, 2, 3, 4):
        _complete(tmp_path, step)
    (tmp_path / ".step_00000005.tmp-0000").mkdir()
    (tmp_path / ".step_00000002.old-0000").mkdir()
    (tmp_path / "notes.txt").write_text("kept")
    _prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "step_00000003", "step_00000004"]
    _prune(tmp_path, keep=0)  # keep everything
    assert len(list(tmp_path.iterdir())) == 3
