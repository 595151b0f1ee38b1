"""The on-disk format of one checkpoint: atomic, verifiable ``torch.distributed.checkpoint`` saves.

    root/
      .step_00000010.tmp-<id>/        1. all ranks: DCP save, one file per rank + .metadata
           meta.json                  2. rank 0: run metadata (format, config, step, losses), fsync'd
           COMPLETE                   3. rank 0: the marker: the step, every file's size and CRC-32, fsync'd
      step_00000010/                  4. rank 0: one atomic rename

A checkpoint counts only with its marker, and only while every file has the size and the CRC-32
the marker recorded and both metadata files parse (``checkpoint_problem``). A ``step_<n>`` folder
holding none of the marker, ``meta.json`` and DCP's ``.metadata`` is not a checkpoint at all
(``is_checkpoint``): someone else's, never read, replaced or removed. The rules of a directory of
them (which one is newest, what is pruned, the lock) are ``manager.py``'s.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
import zlib
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import AsyncStager

from modelpar.checkpoint.shards import Shard, ShardedState, ShardLoadPlanner, ShardSavePlanner, to_save

__all__ = ["FORMAT", "MARKER", "META", "checkpoint_problem", "checkpoint_step", "checkpoints", "file_crc32",
           "final_path", "foreign", "is_checkpoint", "leftovers", "load_into", "publish", "read_full_tensors",
           "read_meta", "remove", "remove_leftovers", "scratch", "seal", "start_write", "step_dirs", "write_files"]

FORMAT = 2  # meta.json's "checkpoint_format": full tensors under global names (none: per-shard keys, older)
MARKER = "COMPLETE"
META = "meta.json"
DCP_METADATA = ".metadata"  # DCP's index of the chunks
_PREFIX = "step_"
_SCRATCH = (".tmp-", ".old-")  # hidden directories of a save in progress (or torn by a crash), or being removed
_BLOCK = 1 << 24  # bytes read at a time for a checksum


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


def checkpoint_step(path: str | os.PathLike) -> int:
    """The training step a checkpoint directory ``step_<n>`` was written at."""
    return int(Path(path).name[len(_PREFIX):])


def step_dirs(root: str | os.PathLike) -> list[Path]:
    """Every ``step_<n>`` directory under ``root`` (with a marker or not), newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(_PREFIX) and p.name[len(_PREFIX):].isdigit()
             and p.is_dir()]
    return sorted(found, key=checkpoint_step, reverse=True)


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether folder ``path`` is a modelpar checkpoint, complete or damaged: it holds the marker,
    ``meta.json`` or DCP's ``.metadata``. Any other ``step_<n>`` folder is someone else's."""
    return any((Path(path) / name).is_file() for name in (MARKER, META, DCP_METADATA))


def checkpoints(root: str | os.PathLike) -> list[Path]:
    """The ``step_<n>`` checkpoints under ``root``, newest first (complete or damaged: ``checkpoint_problem`` says)."""
    return [p for p in step_dirs(root) if is_checkpoint(p)]


def foreign(root: str | os.PathLike) -> list[Path]:
    """The ``step_<n>`` folders under ``root`` that are not checkpoints (``is_checkpoint``), newest first."""
    return [p for p in step_dirs(root) if not is_checkpoint(p)]


def file_crc32(path: str | os.PathLike) -> int:
    """The CRC-32 (zlib) of a file's bytes, read in 16 MiB blocks."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def checkpoint_problem(path: str | os.PathLike, checksums: bool = True) -> str:
    """Why checkpoint ``path`` cannot be loaded ("" if it is complete): the files its marker lists,
    their sizes, ``meta.json``'s CRC-32 (always: it is small, and the run's settings are read from
    it), both metadata files, and with ``checksums`` every file's CRC-32, which reads every byte once.

    The marker is checked before the format, so a damaged ``meta.json`` is damage, never taken for
    an older format. A checkpoint of the older format (a marker without file sizes, a ``meta.json``
    without ``checkpoint_format``) is not a problem here: loading it says that it predates
    resharding. A marker written before checksums (sizes only) is checked by sizes.
    """
    path = Path(path)
    if not (path / MARKER).is_file():
        return f"no {MARKER} marker"
    try:
        marker: Any = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        marker, unreadable = None, f"unreadable {MARKER} marker ({err})"
    else:
        unreadable = f"unreadable {MARKER} marker (no file sizes in it)"
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict):  # the older format's marker, or a damaged one: meta.json says which
        meta, why = _meta(path)
        return why or (unreadable if "checkpoint_format" in meta else "")
    crcs = marker.get("crc32") if isinstance(marker.get("crc32"), dict) else {}
    for name, size in sorted(files.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} is {file.stat().st_size} bytes, {size} were written"
    why = _crc_problem(path, {name: crc for name, crc in crcs.items() if name == META})
    meta, unparsed = _meta(path)
    if why or unparsed or "checkpoint_format" not in meta:
        return why or unparsed or f"{META} has no checkpoint_format, though its marker lists the files' sizes"
    try:
        dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # any unpickling error: the file is damaged
        return f"unreadable DCP metadata ({type(err).__name__}: {err})"
    return _crc_problem(path, crcs) if checksums else ""


def _crc_problem(path: Path, crcs: dict[str, int]) -> str:
    """The first file of ``crcs`` (name -> CRC-32 written) in checkpoint ``path`` whose bytes differ ("" if none)."""
    for name, crc in sorted(crcs.items()):
        try:
            found = file_crc32(path / name)
        except OSError as err:
            return f"{name} is unreadable ({err.strerror or err})"
        if found != crc:
            return f"{name} is damaged (CRC-32 {found:08x}, {crc:08x} was written)"
    return ""


def _meta(path: Path) -> tuple[dict[str, Any], str]:
    """(checkpoint ``path``'s ``meta.json``, "") or ({}, why it cannot be read)."""
    try:
        meta = json.loads((path / META).read_text(encoding="utf-8"))
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        return {}, f"unreadable {META} ({err})"
    return meta, ""


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


def write_files(tmp: Path, state: ShardedState, group: Any, planner: ShardSavePlanner | None = None) -> dict[str, int]:
    """Collective over ``group``: DCP-save ``state`` (this rank's shards) into directory ``tmp``; return
    the CRC-32 of the files this rank wrote (``__<rank>_*``; rank 0 also ``.metadata``), read back once.
    ``planner``: one kept from the previous save reuses its plan where nothing changed (``ShardSavePlanner``)."""
    dcp.save(to_save(state.shards), storage_writer=dcp.FileSystemWriter(str(tmp)), planner=planner or ShardSavePlanner(),
             process_group=group)  # returns once every rank's file and the .metadata are written
    return _own_crcs(tmp, dist.get_rank(group))


def _own_crcs(tmp: Path, rank: int) -> dict[str, int]:
    """The CRC-32 of the files rank ``rank`` wrote into ``tmp`` (``__<rank>_*``; rank 0 also ``.metadata``)."""
    mine = [p for p in tmp.iterdir() if p.name.startswith(f"__{rank}_") or (rank == 0 and p.name == DCP_METADATA)]
    return {p.name: file_crc32(p) for p in mine}


class _AlreadyStaged(AsyncStager):
    """DCP's staging step for a state already copied to host memory (``ShardedState.snapshot``, taken and agreed on
    by every rank before the write starts): nothing left to copy, nothing to wait for."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def start_write(tmp: Path, staged: ShardedState, group: Any,
                planner: ShardSavePlanner | None = None) -> Future[dict[str, int]]:
    """Collective over ``group``: ``write_files`` of ``staged`` (a host copy, ``ShardedState.snapshot``: training may
    change the originals at once) in the background: DCP's ``async_save`` writes it in a thread of its own, whose
    collectives use ``group``: give it a group nothing else uses meanwhile. The future: this rank's CRC-32s.
    ``planner`` as for ``write_files``; it is used in that thread until the future is done."""
    rank = dist.get_rank(group)
    upload = dcp.async_save(to_save(staged.shards), storage_writer=dcp.FileSystemWriter(str(tmp)),
                            planner=planner or ShardSavePlanner(), process_group=group, async_stager=_AlreadyStaged())
    crcs: Future[dict[str, int]] = Future()

    def read_back(done: Any) -> None:  # in the writing thread: the checksums are read there too
        try:
            done.result()
            crcs.set_result(_own_crcs(tmp, rank))
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            crcs.set_exception(err)

    assert isinstance(upload, Future)  # a stager that copies in ``stage`` gets a plain future
    upload.add_done_callback(read_back)
    return crcs


def seal(directory: Path, step: int, meta: dict[str, Any], crcs: dict[str, int] | None = None) -> None:
    """Write the metadata, then the marker with every file's size and CRC-32, both fsync'd: the checkpoint
    is complete. ``crcs``: those the writers computed; the others are computed here."""
    text = json.dumps({**meta, "step": step, "checkpoint_format": FORMAT}, indent=1, sort_keys=True)
    _fsync_write(directory / META, text)
    crcs = {**(crcs or {}), META: zlib.crc32(text.encode("utf-8"))}
    files = {p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.is_file()}
    crcs = {name: crcs[name] if name in crcs else file_crc32(directory / name) for name in files}
    _fsync_write(directory / MARKER, json.dumps({"step": step, "files": files, "crc32": crcs}, indent=1) + "\n")
    _fsync_dir(directory)


def publish(tmp: Path, final: Path) -> None:
    """Rename the sealed ``tmp`` to ``final`` (replacing a checkpoint of the same step) and fsync the parent."""
    if final.exists():  # re-saving a step (after a resume): move the old one out of the way
        if not is_checkpoint(final):
            raise FileExistsError(f"{str(final)!r} is not a checkpoint (someone else's folder): it is left as it is")
        remove(final)
    tmp.rename(final)
    _fsync_dir(final.parent)


def remove(path: Path) -> None:
    """Delete checkpoint ``path``: renamed away first (one atomic step a reader sees), then removed."""
    trash = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
    path.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def scratch(root: Path, step: int) -> Path:
    """A new hidden temporary directory for the save of ``step``."""
    tmp = root / f".{_PREFIX}{step:08d}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def final_path(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"{_PREFIX}{step:08d}"


def load_into(path: str | os.PathLike, state: ShardedState, *, group: Any) -> dict[str, Any]:
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
