"""A run's checkpoint directory: one writer, no torn leftovers, and the checkpoint to continue from.

At the start of ``train``, two collectives over the run's group, each decided on its rank 0 and
shared, so a refusal is the same ValueError on every rank (rank 0 reports what it did as notes):
``CheckpointDir.open`` locks the directory for the run and removes the temporary directories of
a save a crash interrupted; ``choose`` (once the data is prepared) picks the newest complete
checkpoint to resume from, passing over damaged ones, and checks that it fits the run.
``check_directory`` and ``check_resume`` make the same refusals in the launching process, before
any rank starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from modelpar.checkpoint import DirLock, check_unlocked, latest_checkpoint, read_meta, remove_leftovers
from modelpar.training.config import TrainConfig
from modelpar.training.state import check_meta

__all__ = ["CheckpointDir", "check_directory", "check_resume"]

Note = Callable[[str], None]


def _resume_point(cfg: TrainConfig, root: Path, notes: list[str]) -> Path | None:
    """The checkpoint to resume from (None: start at step 0); ValueError if it does not fit ``cfg``."""
    skipped: list[tuple[Path, str]] = []
    path = latest_checkpoint(root, skipped)
    notes += [f"warning: skipping damaged checkpoint {str(p)!r} ({why})" for p, why in skipped]
    if path is None:
        notes.append(f"no complete checkpoint in {str(root)!r}: starting from step 0")
        return None
    meta = read_meta(path)
    check_meta(meta, cfg, str(path))
    was = meta["config"]
    notes.append(f"resuming from {str(path)!r} at step {meta['step']} (written by t={was['tp']} p={was['pp']} "
                 f"d={was['dp']} {was['schedule']}, v={was['chunks']}; now t={cfg.tp} p={cfg.pp} d={cfg.dp} "
                 f"{cfg.schedule}, v={cfg.chunks})")
    return path


def _directory(cfg: TrainConfig) -> Path:
    root = Path(cfg.checkpoint_dir or "")
    if root.exists() and not root.is_dir():
        raise ValueError(f"checkpoint_dir must be a directory, got {str(root)!r}, which is a file")
    return root


def check_directory(cfg: TrainConfig) -> None:
    """Before writing anything: ValueError if the directory is locked by a live run or is a file."""
    if cfg.checkpoint_dir:
        check_unlocked(_directory(cfg))


def check_resume(cfg: TrainConfig) -> None:
    """Before starting ranks (data prepared): ValueError if the checkpoint to resume from belongs to
    another model, data or optimisation."""
    if cfg.checkpoint_dir and cfg.resume:
        _resume_point(cfg, _directory(cfg), [])


def _agree(group: Any, decide: Callable[[], Any]) -> Any:
    """``decide()`` on the group's rank 0, its result (or its ValueError / OSError) on every rank."""
    outcome: tuple[Any, str] = (None, "")
    if dist.get_rank(group) == 0:
        try:
            outcome = (decide(), "")
        except (ValueError, OSError) as err:  # OSError: e.g. a directory this user may not write
            outcome = (None, str(err))
    box = [outcome]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    value, error = box[0]
    if error:
        raise ValueError(error)
    return value


@dataclass
class CheckpointDir:
    """The checkpoint directory of a running ``train``: its rank 0's lock, and where notes go."""

    group: Any
    note: Note | None = None
    lock: DirLock | None = None

    @classmethod
    def open(cls, cfg: TrainConfig, *, group: Any, note: Note | None = None) -> CheckpointDir:
        """Collective over ``group``: lock the directory and remove torn saves (on its rank 0)."""
        found = cls(group, note)
        if cfg.checkpoint_dir:
            try:
                _agree(group, lambda: found._lock(_directory(cfg)))
            except ValueError:
                found.close()
                raise
        return found

    def _lock(self, root: Path) -> None:
        lock = DirLock(root)
        warning = lock.acquire()
        self.lock = lock
        self._say([f"warning: {warning}"] if warning else [])
        self._say([f"removed {str(p)!r}, a checkpoint save that never completed" for p in remove_leftovers(root)])

    def choose(self, cfg: TrainConfig) -> Path | None:
        """Collective: the checkpoint to resume from (None: start at step 0), checked against ``cfg``."""
        if not (cfg.checkpoint_dir and cfg.resume):
            return None

        def decide() -> str | None:
            notes: list[str] = []
            try:
                path = _resume_point(cfg, _directory(cfg), notes)
            finally:  # what was found before an error too
                self._say(notes)
            return str(path) if path else None

        path = _agree(self.group, decide)
        return Path(path) if path else None

    def _say(self, notes: list[str]) -> None:
        if self.note is not None:
            for text in notes:
                self.note(text)

    def close(self) -> None:
        """Release the lock (rank 0; a no-op elsewhere)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None
