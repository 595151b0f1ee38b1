"""Checkpoint directories: atomic, verifiable ``torch.distributed.checkpoint`` saves of a ``ShardedState``.

    root/
      LOCK                            the run that writes here (``modelpar.checkpoint.lock``)
      .step_00000010.tmp-<id>/        1. all ranks: DCP save, one file per rank + .metadata
           meta.json                  2. rank 0: run metadata (format, config, step, losses), fsync'd
           COMPLETE                   3. rank 0: the marker: the step and every file's size, fsync'd
      step_00000010/                  4. rank 0: one atomic rename; older checkpoints pruned

A checkpoint counts only with its marker, and only while every file has the size the marker
recorded and both metadata files parse (``checkpoint_problem``): a torn write is never renamed,
a truncated or damaged one is skipped for the previous complete one. Leftover temporary
directories from a crash are removed by the next run (``remove_leftovers``) and by every save.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from modelpar.checkpoint.shards import Shard, ShardedState, ShardLoadPlanner, ShardSavePlanner

__all__ = ["FORMAT", "MARKER", "META", "checkpoint_problem", "checkpoint_step", "latest_checkpoint",
           "leftovers", "load_checkpoint", "read_full_tensors", "read_meta", "remove_leftovers", "save_checkpoint"]

FORMAT = 2  # meta.json's "checkpoint_format": full tensors under global names (none: per-shard keys, older)
MARKER = "COMPLETE"
META = "meta.json"
_PREFIX = "step_"
_SCRATCH = (".tmp-", ".old-")  # hidden directories of a save in progress (or torn by a crash)


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


def _broadcast(value: Any, group: Any) -> Any:
    obj = [value]
    dist.broadcast_object_list(obj, src=dist.get_global_rank(group, 0), group=group)
    return obj[0]


def checkpoint_step(path: str | os.PathLike) -> int:
    """The training step a checkpoint directory ``step_<n>`` was written at."""
    return int(Path(path).name[len(_PREFIX):])


def _marked(root: Path) -> list[Path]:
    """``step_<n>`` directories with a marker, newest first."""
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir()
            if p.name.startswith(_PREFIX) and p.name[len(_PREFIX):].isdigit() and (p / MARKER).is_file()]
    return sorted(done, key=checkpoint_step, reverse=True)


def checkpoint_problem(path: str | os.PathLike) -> str:
    """Why checkpoint ``path`` cannot be loaded ("" if it looks complete), from sizes and metadata only.

    A checkpoint of an older format is not a problem here: loading it says that it predates resharding.
    """
    path = Path(path)
    if not (path / MARKER).is_file():
        return f"no {MARKER} marker"
    try:
        meta = json.loads((path / META).read_text(encoding="utf-8"))
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        return f"unreadable {META} ({err})"
    if "checkpoint_format" not in meta:
        return ""
    try:
        marker = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return f"unreadable {MARKER} marker ({err})"
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict):
        return f"unreadable {MARKER} marker (no file sizes in it)"
    for name, size in sorted(files.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} is {file.stat().st_size} bytes, {size} were written"
    try:
        dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # any unpickling error: the file is damaged
        return f"unreadable DCP metadata ({type(err).__name__}: {err})"
    return ""


def latest_checkpoint(root: str | os.PathLike, skipped: list[tuple[Path, str]] | None = None) -> Path | None:
    """The newest checkpoint under ``root`` that passes ``checkpoint_problem`` (None if there is none).

    Newer marked ones that fail are passed over and appended to ``skipped`` as (path, reason).
    """
    for path in _marked(Path(root)):
        problem = checkpoint_problem(path)
        if not problem:
            return path
        if skipped is not None:
            skipped.append((path, problem))
    return None


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata rank 0 stored with a checkpoint; ValueError if it is not a complete one of this format."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise ValueError(f"{str(path)!r} is not a complete checkpoint (no {MARKER} marker)")
    try:
        meta = json.loads((path / META).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"checkpoint {str(path)!r} has an unreadable {META}: {err}") from None
    version = meta.get("checkpoint_format") if isinstance(meta, dict) else None
    if version is None:
        raise ValueError(f"checkpoint {str(path)!r} predates resharding (it stores tensor-parallel shards, not "
                         "full tensors) and cannot be loaded by this modelpar; train again to get a checkpoint "
                         "that resumes at any split")
    if version != FORMAT:
        raise ValueError(f"checkpoint {str(path)!r} has format {version}; this modelpar reads format {FORMAT}")
    return meta


def leftovers(root: str | os.PathLike) -> list[Path]:
    """Temporary directories of saves that never completed (a crash or a kill mid-write)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and p.name.startswith(f".{_PREFIX}") and any(s in p.name for s in _SCRATCH))


def remove_leftovers(root: str | os.PathLike) -> list[Path]:
    """Delete ``leftovers(root)``; return what was removed."""
    found = leftovers(root)
    for p in found:
        shutil.rmtree(p, ignore_errors=True)
    return found


def save_checkpoint(root: str | os.PathLike, step: int, state: ShardedState, meta: dict[str, Any], *,
                    group: Any, keep: int = 2) -> Path:
    """Collective over ``group``: write ``state`` (this rank's shards) as ``root/step_<step>``; return its path.

    ``meta`` (JSON-serialisable, the same on every rank) is stored by the group's rank 0. Only the
    newest ``keep`` complete checkpoints are kept (``keep=0`` keeps all).
    """
    root = Path(root)
    rank = dist.get_rank(group)
    final = root / f"{_PREFIX}{step:08d}"
    tmp_name = ""
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        tmp_name = f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
        (root / tmp_name).mkdir()
    tmp = root / _broadcast(tmp_name, group)
    dcp.save(state.shards, storage_writer=dcp.FileSystemWriter(str(tmp)), planner=ShardSavePlanner(),
             process_group=group)  # returns once every rank's file and the .metadata are written
    if rank == 0:
        _seal(tmp, step, meta)
        if final.exists():  # re-saving a step (after a resume): move the old one out of the way
            trash = root / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            final.rename(trash)
            shutil.rmtree(trash, ignore_errors=True)
        tmp.rename(final)
        _fsync_dir(root)
        _prune(root, keep)
    dist.barrier(group)
    return final


def _seal(directory: Path, step: int, meta: dict[str, Any]) -> None:
    """Write the metadata, then the marker with every file's size, both fsync'd: the checkpoint is complete."""
    _fsync_write(directory / META, json.dumps({**meta, "step": step, "checkpoint_format": FORMAT}, indent=1,
                                              sort_keys=True))
    files = {p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.is_file()}
    _fsync_write(directory / MARKER, json.dumps({"step": step, "files": files}, indent=1) + "\n")
    _fsync_dir(directory)


def _prune(root: Path, keep: int) -> None:
    """Drop leftover temporary directories and all but the newest ``keep`` checkpoints."""
    remove_leftovers(root)
    if keep > 0:
        for p in _marked(root)[keep:]:
            shutil.rmtree(p, ignore_errors=True)


def load_checkpoint(path: str | os.PathLike, state: ShardedState, *, group: Any) -> dict[str, Any]:
    """Collective over ``group``: fill ``state``'s tensors in place from checkpoint ``path``; return its metadata.

    Every rank asks for the boxes it holds now, whatever split wrote them. Raises ValueError on every
    rank, before reading any tensor, if the checkpoint lacks one of a rank's names or holds it with
    another full shape.
    """
    meta = read_meta(path)
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    problem = _mismatch(path, state, stored)
    on_gpu = dist.get_backend(group) == "nccl"
    flag = torch.tensor([1.0 if problem else 0.0], device="cuda" if on_gpu else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)  # every rank raises, or none
    if flag.item():
        raise ValueError(problem or f"checkpoint {str(path)!r} does not match this run on another rank: it was "
                         "written by a different model")
    dcp.load(state.shards, storage_reader=dcp.FileSystemReader(str(path)), planner=ShardLoadPlanner(),
             process_group=group)
    state.fill_copies()
    return meta


def _mismatch(path: Any, state: ShardedState, stored: dict[str, Any]) -> str:
    """Why this rank's shards cannot be loaded from ``stored`` ("" if they can)."""
    missing = [name for name in state if name not in stored]
    if missing:
        return (f"checkpoint {str(path)!r} has no entry {missing[0]!r} ({len(missing)} of this rank's "
                f"{len(state)} missing): it was written by a different model")
    for name, shard in state.shards.items():
        shape = tuple(getattr(stored[name], "size", ()))
        if shape != shard.shape:
            return f"checkpoint {str(path)!r}: {name!r} has shape {shape}, this run expects {shard.shape}"
    return ""


def read_full_tensors(path: str | os.PathLike, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Every full tensor whose name starts with ``prefix`` (the prefix dropped), read in this process.

    No process group is needed: DCP assembles each tensor from the chunks every rank wrote.
    """
    read_meta(path)
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = ShardedState()
    for name, entry in stored.items():
        if name.startswith(prefix) and isinstance(entry, TensorStorageMetadata):
            state.add(name, Shard.whole(torch.empty(tuple(entry.size), dtype=entry.properties.dtype)))
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state.shards, storage_reader=dcp.FileSystemReader(str(path)), planner=ShardLoadPlanner(),
                 no_dist=True)
    return {name[len(prefix):]: shard.pieces[0].tensor for name, shard in state.shards.items()}
