"""A run's checkpoint directory as training sees it: the ``CheckpointManager`` and the run's own checks.

The directory's rules (one writer, what counts, keep-N, fresh runs, save and load) are
``modelpar.checkpoint.manager``'s; this module adds what belongs to training: whether a
checkpoint fits this run (``check_meta``) and the note saying where a run resumes.
``check_directory`` and ``check_resume`` make the manager's refusals in the launching process,
before any rank starts; under torchrun the ranks make them (``open_directory``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from modelpar.checkpoint import CheckpointManager, check_fresh, check_unlocked, read_meta
from modelpar.training.config import TrainConfig
from modelpar.training.state import check_meta

__all__ = ["check_directory", "check_flags", "check_resume", "fits", "open_directory", "resume_check"]


def fits(cfg: TrainConfig) -> Callable[[Path, list[str]], None]:
    """The check of a checkpoint to resume from: ValueError if it does not fit ``cfg``, else a note."""
    def check(path: Path, notes: list[str]) -> None:
        meta = read_meta(path)
        check_meta(meta, cfg, str(path))
        was = TrainConfig.from_dict(meta["config"])
        notes.append(f"resuming from {str(path)!r} at step {meta['step']} (written by {_layout(was)}; "
                     f"now {_layout(cfg)})")
    return check


def _layout(cfg: TrainConfig) -> str:
    """The split and schedule in words: ``t=1, cp=2, p=2, d=1, 1f1b, v=1`` (``TrainConfig.layout``, cp and ep when used)."""
    return f"{cfg.layout()}, {cfg.schedule}, v={cfg.chunks}"


def _root(cfg: TrainConfig) -> Path:
    root = Path(cfg.checkpoint_dir or "")
    if root.exists() and not root.is_dir():
        raise ValueError(f"checkpoint_dir must be a directory, got {str(root)!r}, which is a file")
    return root


def check_directory(cfg: TrainConfig) -> None:
    """Before writing anything: ValueError if the directory is a file, is locked by a live run, or
    holds an earlier run's checkpoints while this run neither resumes nor overwrites."""
    if cfg.checkpoint_dir:
        root = _root(cfg)
        check_unlocked(root)
        check_fresh(root, resume=cfg.resume, overwrite=cfg.overwrite)


def check_flags(cfg: TrainConfig) -> None:
    """On the command line: ValueError for a checkpoint flag that needs ``--checkpoint-dir`` without one
    (``--exit-after`` promises a checkpoint; ``--overwrite`` names checkpoints to delete)."""
    if cfg.checkpoint_dir:
        return
    if cfg.exit_after:
        raise ValueError(f"--exit-after {cfg.exit_after} stops with a checkpoint, which needs --checkpoint-dir (where "
                         "to write it), got none")
    if cfg.overwrite:
        raise ValueError("--overwrite deletes the checkpoints in --checkpoint-dir, which is not given")


def check_resume(cfg: TrainConfig) -> None:
    """Before starting ranks (data prepared): ValueError if the checkpoint to resume from belongs to
    another model, data or optimisation, or if checkpoints exist and none is valid."""
    if cfg.checkpoint_dir and cfg.resume:
        CheckpointManager(_root(cfg)).resume_point([], fits(cfg))


def resume_check(checkpoints: CheckpointManager | None) -> Callable[[TrainConfig], None] | None:
    """``check_resume`` through the run's own manager (its checksums then read once), for ``prepare_on_rank0``."""
    if checkpoints is None:
        return None
    manager = checkpoints

    def check(cfg: TrainConfig) -> None:
        if cfg.resume:
            manager.resume_point([], fits(cfg))
    return check


def open_directory(cfg: TrainConfig, *, group: Any, note: Callable[[str], None] | None = None) -> CheckpointManager | None:
    """Collective: the run's manager, its directory locked and checked (None: the run has no checkpoint_dir)."""
    if not cfg.checkpoint_dir:
        return None
    manager = CheckpointManager(cfg.checkpoint_dir, group=group, keep=cfg.keep, note=note)
    manager.open(resume=cfg.resume, overwrite=cfg.overwrite)
    return manager
