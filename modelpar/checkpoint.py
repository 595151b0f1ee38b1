"""Sharded, crash-safe checkpoints with ``torch.distributed.checkpoint`` (DCP).

Every rank passes a flat ``{key: tensor}`` dict; keys name the shard (e.g. ``model.layers.0.mlp.fc1.
weight|tp1``), so tensor-parallel shards and pipeline stages are distinct entries and
data-parallel replicas, which hold identical tensors under identical keys, are written once
(DCP's de-duplication). Each rank writes its own file.

Atomicity (a crash mid-write never leaves a checkpoint that loads as complete)::

    root/.step_00000010.tmp-<id>/   1. all ranks: DCP save into a hidden temporary directory
         ├── __0_0.distcp ...
         ├── meta.json             2. rank 0: run metadata (model config, split, step, ...)
         └── COMPLETE              3. rank 0: completion marker, fsync'd
    root/step_00000010/            4. rank 0: one atomic rename; older checkpoints pruned

``latest_checkpoint`` only considers ``step_*`` directories that carry the marker; a leftover
temporary directory from a crash is ignored and removed by the next save.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

__all__ = ["MARKER", "checkpoint_step", "latest_checkpoint", "load_checkpoint", "read_meta",
           "save_checkpoint"]

MARKER = "COMPLETE"
META = "meta.json"
_PREFIX = "step_"


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _broadcast_str(value: str, group: Any) -> str:
    obj = [value]
    dist.broadcast_object_list(obj, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    return obj[0]


def checkpoint_step(path: str | os.PathLike) -> int:
    """The training step a checkpoint directory ``step_<n>`` was written at."""
    return int(Path(path).name[len(_PREFIX):])


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step under ``root`` (None if there is none)."""
    root = Path(root)
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir()
            if p.name.startswith(_PREFIX) and p.name[len(_PREFIX):].isdigit() and (p / MARKER).is_file()]
    return max(done, key=checkpoint_step, default=None)


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata rank 0 stored with a checkpoint; ValueError if it is not a complete one."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise ValueError(f"checkpoint {str(path)!r} is not a complete checkpoint (no {MARKER} marker)")
    return json.loads((path / META).read_text(encoding="utf-8"))


def save_checkpoint(root: str | os.PathLike, step: int, state: dict[str, torch.Tensor],
                    meta: dict[str, Any], *, group: Any = None, keep: int = 2) -> Path:
    """Collective: write ``state`` (this rank's tensors) as ``root/step_<step>``; return its path.

    ``meta`` (JSON-serialisable, the same on every rank) is stored by rank 0. Only the newest
    ``keep`` complete checkpoints are kept (``keep=0`` keeps all).
    """
    root = Path(root)
    rank = dist.get_rank(group)
    final = root / f"{_PREFIX}{step:08d}"
    tmp_name = ""
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        tmp_name = f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
        (root / tmp_name).mkdir()
    tmp = root / _broadcast_str(tmp_name, group)
    dcp.save(state, checkpoint_id=tmp, process_group=group)  # returns once every shard is written
    if rank == 0:
        _fsync_write(tmp / META, json.dumps({**meta, "step": step}, indent=1, sort_keys=True))
        _fsync_write(tmp / MARKER, f"{step}\n")
        _fsync_dir(tmp)
        if final.exists():  # re-saving a step (after a resume): move the old one out of the way
            trash = root / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            final.rename(trash)
            shutil.rmtree(trash, ignore_errors=True)
        tmp.rename(final)
        _fsync_dir(root)
        _prune(root, keep)
    dist.barrier(group)
    return final


def _prune(root: Path, keep: int) -> None:
    """Drop leftover temporary directories and all but the newest ``keep`` checkpoints."""
    for p in root.iterdir():
        if p.name.startswith(f".{_PREFIX}") and (".tmp-" in p.name or ".old-" in p.name):
            shutil.rmtree(p, ignore_errors=True)
    if keep > 0:
        done = sorted((p for p in root.iterdir() if p.name.startswith(_PREFIX) and (p / MARKER).is_file()),
                      key=checkpoint_step)
        for p in done[:-keep]:
            shutil.rmtree(p, ignore_errors=True)


def load_checkpoint(path: str | os.PathLike, state: dict[str, torch.Tensor], *,
                    group: Any = None) -> dict[str, Any]:
    """Collective: fill ``state``'s tensors in place from checkpoint ``path``; return its metadata.

    Raises ValueError on every rank, before reading any tensor, if the checkpoint is incomplete or
    lacks one of this rank's keys, or a tensor's shape differs.
    """
    meta = read_meta(path)
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    problem = _mismatch(path, state, stored)
    on_gpu = dist.get_backend(group) == "nccl"
    flag = torch.tensor([1.0 if problem else 0.0], device="cuda" if on_gpu else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)  # every rank raises, or none
    if flag.item():
        raise ValueError(problem or f"checkpoint {str(path)!r} does not match this run on another "
                         "rank: it was written by a different model or parallel split")
    dcp.load(state, checkpoint_id=str(path), process_group=group)
    return meta


def _mismatch(path: Any, state: dict[str, torch.Tensor], stored: dict[str, Any]) -> str:
    """Why this rank's tensors cannot be loaded from ``stored`` ("" if they can)."""
    missing = [k for k in state if k not in stored]
    if missing:
        return (f"checkpoint {str(path)!r} has no entry for {missing[0]!r} ({len(missing)} of this "
                f"rank's {len(state)} tensors missing): it was written by a different model or split")
    for key, tensor in state.items():
        shape = tuple(getattr(stored[key], "size", ()))
        if shape != tuple(tensor.shape):
            return (f"checkpoint {str(path)!r}: {key!r} has shape {shape}, "
                    f"this run expects {tuple(tensor.shape)}")
    return ""
